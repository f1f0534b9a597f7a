"""Decode speed of a sliding-window Decoder (issue 17): microseconds per one-token step over a long run, for
the ring-buffer decode state (`memory/window_state.py`: w key slots per layer, written at slot t mod w)
against the earlier policy it replaced, kept here as the reference: a linear state of w + max(16, w / 4)
positions that, when full, moves the last w - 1 keys down (`DecodeState.slide`).

    OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.window_decode [--tokens 4096] [--window 256] [--rounds 3]

One Decoder (dim 128, depth 2, 4 heads, rotary, no learned positions), batch 1; each round runs both states
over the same `--tokens` random tokens one step at a time, alternating which goes first; prints each
round's us/token and the medians' ratio, and the key slots each state holds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from polyformer import Decoder, TransformerWrapper
from polyformer.memory.kv_cache import DecodeState


def model(window: int, dim: int, depth: int) -> TransformerWrapper:
    torch.manual_seed(0)
    return TransformerWrapper(num_tokens=256, max_seq_len=512, use_abs_pos_emb=False,
                              attn_layers=Decoder(dim=dim, depth=depth, heads=4, rotary_pos_emb=True,
                                                  attn_window=window)).eval()


def sliding(net: TransformerWrapper) -> DecodeState:
    """The replaced policy's state: the window plus max(16, w / 4) positions of room to slide into."""
    sinks, span = net.attn_layers.window
    a = next(b.branch for b in net.attn_layers.blocks if b.kind == "a")
    return DecodeState(net.attn_layers.num_self_attn, 1, sinks + span + max(16, span // 4), *a.decode_dims)


def run(net: TransformerWrapper, tokens: torch.Tensor, ring: bool) -> tuple[float, int]:
    """us per step over tokens (1, n), and the state's key slots."""
    span = net.attn_layers.window[1]
    state = net.new_state(1, tokens.shape[1], history=0) if ring else sliding(net)
    start = time.perf_counter()
    with torch.no_grad():
        for t in range(tokens.shape[1]):
            if not ring and state.length == state.max_len:      # the old policy: drop all but the last w - 1
                state.slide(state.length - (span - 1))           # (no sinks in this benchmark)
            net(tokens[:, t: t + 1], state=state)
    return (time.perf_counter() - start) / tokens.shape[1] * 1e6, state.k.shape[3]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    net = model(args.window, args.dim, args.depth)
    tokens = torch.randint(0, 256, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    run(net, tokens[:, :64], True), run(net, tokens[:, :64], False)      # warm up
    times: dict[bool, list[float]] = {True: [], False: []}
    slots = {}
    for r in range(args.rounds):
        for ring in ((True, False) if r % 2 == 0 else (False, True)):
            us, slots[ring] = run(net, tokens, ring)
            times[ring].append(us)
        print(f"round {r}: ring {times[True][-1]:.0f} us/token, sliding {times[False][-1]:.0f} us/token", flush=True)
    ring, slide = statistics.median(times[True]), statistics.median(times[False])
    print(f"w={args.window}, {args.tokens} tokens, dim {args.dim}, depth {args.depth}, threads "
          f"{torch.get_num_threads()}: ring {ring:.0f} us/token ({slots[True]} slots), sliding {slide:.0f} "
          f"us/token ({slots[False]} slots); ring / sliding {ring / slide:.2f}")


if __name__ == "__main__":
    main()
