"""Landmark attention (issue 21): generation and forward time at long context, top-k retrieval against the
full grouped softmax and against plain dense attention, same process, alternating rounds.

    python -m benchmarks.landmark [--quick] [--lengths 4096,8192] [--repeats 3] [--out-dir docs/memories]

A decoder of dim 256, 2 layers, 4 heads of 64, rotary, batch 1, float32, 2 threads; landmark blocks of 64 tokens.
Per context n: `generate` times 16 one-token decode steps after a prefilled state of n tokens (the state
cloned before each call, so every call starts alike); `forward` times one eval forward of n tokens. Contenders:
landmark with top-k = 4 (a step reads the landmarks, 4 blocks and its own), landmark without top-k (every key,
the grouped softmax), and dense attention (no landmarks). Ratios are landmark / other (< 1: faster).
There is no PyPI package of the paper's method to set beside it (its reference repository is a training
codebase). --quick: n 1024, 1 round, output under /tmp.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch

from polyformer import Decoder, TransformerWrapper

from .common import (Competitor, environment, markdown_table, measure_points, one_shot_parser, quiet_rounds,
                     spread, started)

BLOCK, TOPK, STEPS, VOCAB = 64, 4, 16, 256


def model(n: int, **keywords: Any) -> TransformerWrapper:
    torch.manual_seed(0)
    layers = Decoder(dim=256, depth=2, heads=4, rotary_pos_emb=True, **keywords)
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=2 * n, attn_layers=layers).eval()


def contenders(n: int) -> dict[str, TransformerWrapper]:
    full = model(n, landmark_block=BLOCK)
    topk = model(n, landmark_block=BLOCK, landmark_topk=TOPK)
    topk.load_state_dict(full.state_dict())
    return {f"landmark top-{TOPK}": topk, "landmark full": full, "dense": model(n)}


def generation(net: TransformerWrapper, n: int) -> Callable[[], None]:
    x = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prefilled = net.new_state(1, n + STEPS)
        net(x, state=prefilled)
    tokens = torch.randint(0, VOCAB, (1, STEPS), generator=torch.Generator().manual_seed(1))

    def run() -> None:
        state = prefilled.clone()
        with torch.no_grad():
            for t in range(STEPS):
                net(tokens[:, t:t + 1], state=state)
    return run


def forward(net: TransformerWrapper, n: int) -> Callable[[], None]:
    x = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(0))

    def run() -> None:
        with torch.no_grad():
            net(x)
    return run


def measure(part: str, n: int, args: Any) -> dict[str, Any]:
    make = generation if part == "generate" else forward
    runs = [Competitor(name, make(net, n), STEPS if part == "generate" else 1) for name, net in contenders(n).items()]
    rounds = quiet_rounds(runs, args.repeats, max_wait=args.max_wait)
    return {"part": part, "n": n, "rounds": len(rounds), "quiet_rounds": sum(r["quiet"] for r in rounds),
            "seconds": {c.name: spread(c.per_unit) for c in runs}}


def markdown(record: dict[str, Any]) -> str:
    out = ["# Landmark attention: top-k retrieval at long context", "",
           f"dim 256, 2 layers, 4 heads of 64, rotary, batch 1, float32, blocks of {BLOCK}, top-{TOPK}. `generate`: "
           f"ms per decode step after n prefilled tokens; `forward`: ms per eval forward of n tokens. Medians of "
           "alternating rounds in one process. Measured by `python -m benchmarks.landmark`.", ""]
    rows = []
    for p in sorted(record["points"].values(), key=lambda p: (p["part"], p["n"])):
        s = {k: v["median"] for k, v in p["seconds"].items()}
        top, full, dense = s[f"landmark top-{TOPK}"], s["landmark full"], s["dense"]
        rows.append([p["part"], p["n"], f"{top * 1e3:.2f}", f"{full * 1e3:.2f}", f"{dense * 1e3:.2f}",
                     f"{top / full:.2f}", f"{top / dense:.2f}", f"{p['quiet_rounds']}/{p['rounds']}"])
    out.append(markdown_table(["part", "n", f"top-{TOPK} ms", "full ms", "dense ms", "top-k / full", "top-k / dense",
                               "quiet rounds"], rows))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = one_shot_parser("benchmarks.landmark", __doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--redo", action="store_true")
    args = started(parser, argv)
    lengths = [1024] if args.quick else [int(n) for n in args.lengths.split(",")]
    if args.quick:
        args.repeats = 1
    out_dir = args.out_dir or (Path("/tmp/landmark_bench") if args.quick else Path("docs/memories"))
    points = [(f"{part}@{n}", lambda part=part, n=n: measure(part, n, args))
              for part in ("generate", "forward") for n in lengths]
    return measure_points(out_dir / "landmark.json", points, redo=args.redo or args.quick, repeats=args.repeats,
                          env=environment(["torch"]), markdown=markdown)


if __name__ == "__main__":
    sys.exit(main())
