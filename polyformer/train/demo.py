"""The built-in demo: trains a small byte-level decoder on standard-library sources, shows the
loss falling, and prints a sample."""

from __future__ import annotations

import argparse
import math
import time

import torch

from ..generate.decode import AutoregressiveWrapper
from ..generate.sampling import top_k
from ..stack import Decoder
from ..wrappers import TransformerWrapper
from .corpus import digest, stdlib_bytes


def batches(data: torch.Tensor, seq_len: int, batch: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=generator)
        yield torch.stack([data[s: s + seq_len + 1] for s in starts.tolist()]).long()


@torch.no_grad()
def evaluate(model: AutoregressiveWrapper, data: torch.Tensor, seq_len: int, n: int = 8) -> float:
    model.eval()
    g = torch.Generator().manual_seed(1)
    loss = sum(model(next(batches(data, seq_len, 16, g))).item() for _ in range(n)) / n
    model.train()
    return loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m polyformer demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.seq_len < 2 or args.batch < 1:
        parser.error("--steps, --batch must be >= 1 and --seq-len >= 2")

    torch.manual_seed(args.seed)
    text = stdlib_bytes(4_000_000)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    split = int(0.95 * data.numel())
    train, val = data[:split], data[split:]
    print(f"corpus: {len(text):,} bytes of standard-library source (sha256 {digest(text)}), "
          f"{train.numel():,} train / {val.numel():,} validation")

    net = TransformerWrapper(num_tokens=256, max_seq_len=args.seq_len,
                             attn_layers=Decoder(dim=args.dim, depth=args.depth, heads=4,
                                                 rotary_pos_emb=True, ff_glu=True))
    model = AutoregressiveWrapper(net)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    stream = batches(train, args.seq_len, args.batch, torch.Generator().manual_seed(args.seed))
    print(f"step {0:5d}  val loss {evaluate(model, val, args.seq_len):.3f}")
    start, running = time.time(), 0.0
    every = max(1, args.steps // 8)
    for step in range(1, args.steps + 1):
        loss = model(next(stream))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running += loss.item()
        if step % every == 0 or step == args.steps:
            n = every if step % every == 0 else step % every
            rate = step * args.batch * args.seq_len / (time.time() - start)
            print(f"step {step:5d}  train loss {running / n:.3f}  val loss "
                  f"{evaluate(model, val, args.seq_len):.3f}  ({rate:,.0f} tokens/s)")
            running = 0.0
    prompt = torch.tensor([list(b"def ")])
    sample = model.generate(prompt, 200, temperature=0.8, filter_logits_fn=top_k, filter_kwargs={"k": 20},
                            generator=torch.Generator().manual_seed(args.seed))
    print("sample:\n" + (bytes(prompt[0].tolist()) + bytes(sample[0].tolist())).decode("utf-8", "replace"))


if __name__ == "__main__":
    main()
