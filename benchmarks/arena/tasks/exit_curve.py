"""Early exit as a speed / quality curve (CALM, arXiv:2207.07061; issue 22): a long-text model trained with
exit layers, measured after training at several thresholds (1 never exits).

Quality is teacher-forced through the decode path: every held-out segment the table scores (the same
segments, positions and targets as the row's loss) runs once against a fresh decode state under the exit
policy, each position stopping at its first exit layer whose confidence passes the threshold, the skipped
layers' keys / values of its position propagated from its exit state, so later positions read what decoding
would have written; its logits are the shared head's at the exit layer. One forward per segment equals the
token-by-token steps (the exit decision is per position and causal; tests/arena/test_exit_curve.py checks it),
so this is the loss, top-1 agreement with the full model, and layers per token that greedy decoding of that
text would see, not an estimate from full-depth hidden states.

Speed is greedy generation from held-out prompts, one prompt at a time (batch 1, where an exited token skips
the rest of the stack: with a batch the layers are skipped only once every row has exited): every threshold
and the plain decode path (`AutoregressiveWrapper.generate`, no exit machinery) generate from the same prompts
to the same length, timed in alternating rounds in one process (tokens per wall-clock second; speedups from
the process's CPU time, which other load on a shared machine disturbs less). Consistency is the fraction of generated
tokens equal to the plain path's greedy tokens (CALM's token-level consistency; 1 at threshold 1, where the
exit path is the full model bit for bit).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polyformer import AutoregressiveWrapper
from polyformer.early_exit import policy_of
from polyformer.generate.early_exit import ExitGeneration, generate

from ...common import Competitor, alternating_rounds

FULL = dict(thresholds=(1.0, 0.99, 0.95, 0.9, 0.8, 0.6), prompts_per_file=2, prompt_len=64, new_tokens=64, rounds=3)
QUICK = dict(thresholds=(1.0, 0.9, 0.6, 0.0), prompts_per_file=1, prompt_len=8, new_tokens=8, rounds=1)


def segments(streams: Tensor, segment: int, warm: int) -> list[Tensor]:
    """The (b, segment + 1) windows of `streams` the long-text evaluation scores (its starts, after `warm`)."""
    return [streams[:, s:s + segment + 1] for s in range(warm, streams.shape[1] - 1 - segment + 1, segment)]


@torch.no_grad()
def teacher_forced(model: nn.Module, segs: list[Tensor], threshold: float,
                   full_top: list[Tensor]) -> dict[str, float]:
    """Mean loss, top-1 agreement with the full model (`full_top`, its argmax per segment) and layers per
    position of the held-out segments decoded under the exit policy at `threshold`, teacher-forced."""
    net, policy = policy_of(model)
    loss = agree = layers = count = 0.0
    for seg, top in zip(segs, full_top):
        b, n = seg.shape[0], seg.shape[1] - 1
        state = net.new_state(b, n)
        with policy.decoding(net.head, threshold) as run:
            logits = net(seg[:, :-1], state=state)
        loss += float(F.cross_entropy(logits.transpose(1, 2).float(), seg[:, 1:], reduction="sum"))
        agree += float((logits.argmax(-1) == top).sum())
        layers += float(run.layers.sum())
        count += b * n
    return {"loss": loss / count, "agreement": agree / count, "mean_layers": layers / count}


def prompts(streams: Tensor, warm: int, per_file: int, length: int) -> Tensor:
    """(files * per_file, length): prompts from the scored part of each held-out stream, evenly spaced."""
    tail = streams.shape[1] - warm - length
    starts = [warm + k * (tail // per_file) for k in range(per_file)]
    return torch.stack([streams[f, s:s + length] for f in range(streams.shape[0]) for s in starts])


def measure(model: nn.Module, streams: Tensor, segment: int, warm: int, settings: dict[str, Any],
            log: Any = None) -> tuple[dict[str, Any], dict[float, ExitGeneration]]:
    """The curve of `model` (a TransformerWrapper with exit_layers, no memory) on the held-out `streams`:
    ({"settings", "plain", "points": one per threshold}, {threshold: its generations, rows concatenated})."""
    found = policy_of(model)
    if found is None:
        raise ValueError("the early-exit curve needs a model built with exit_layers")
    net, policy = found
    if getattr(net, "max_mem_len", 0):
        raise ValueError("the early-exit curve reads segments without memory; the model has max_mem_len")
    if settings["prompt_len"] + settings["new_tokens"] > net.max_seq_len:
        raise ValueError(f"the early-exit curve's prompts ({settings['prompt_len']}) and new tokens "
                         f"({settings['new_tokens']}) exceed the model's max_seq_len={net.max_seq_len}")
    net.eval()
    segs = segments(streams, segment, warm)
    with torch.no_grad():
        full_top = [net(seg[:, :-1]).argmax(-1) for seg in segs]
    thresholds = [float(t) for t in settings["thresholds"]]
    forced = {t: teacher_forced(net, segs, t, full_top) for t in thresholds}

    starts = prompts(streams, warm, settings["prompts_per_file"], settings["prompt_len"])
    new = settings["new_tokens"]
    wrapper = AutoregressiveWrapper(net)
    reference = torch.cat([wrapper.generate(p[None], new, temperature=0.0) for p in starts])
    runs = {t: [generate(net, p[None], new, threshold=t) for p in starts] for t in thresholds}   # also the warm-up
    gens = {t: ExitGeneration(torch.cat([g.tokens for g in r]), torch.cat([g.layers for g in r]), policy.depth)
            for t, r in runs.items()}

    def plain() -> None:
        for p in starts:
            wrapper.generate(p[None], new, temperature=0.0)

    def exiting(t: float):
        return lambda: [generate(net, p[None], new, threshold=t) for p in starts]

    units = len(starts) * new
    plain_c = Competitor("plain", plain, units)
    timed = [plain_c] + [Competitor(f"threshold {t:g}", exiting(t), units) for t in thresholds]
    alternating_rounds(timed, settings["rounds"], warmup=0, log=log)
    per_token = {c.name: statistics.median(c.seconds) / units for c in timed}
    cpu_token = {c.name: statistics.median(c.cpu_seconds) / units for c in timed}
    never = cpu_token[f"threshold {1.0:g}"] if 1.0 in thresholds else None    # speedups: process CPU time
    points = []
    for t, c in zip(thresholds, timed[1:]):
        points.append({"threshold": t, **forced[t], "gen_mean_layers": gens[t].mean_layers,
                       "consistency": float((gens[t].tokens == reference).float().mean()),
                       "tokens_per_s": 1 / per_token[c.name], "cpu_tokens_per_s": 1 / cpu_token[c.name],
                       "speedup": never / cpu_token[c.name] if never else None,
                       "vs_plain": cpu_token["plain"] / cpu_token[c.name]})
    curve = {"settings": {**settings, "thresholds": thresholds, "prompts": len(starts)},
             "plain": {"tokens_per_s": 1 / per_token["plain"], "cpu_tokens_per_s": 1 / cpu_token["plain"]},
             "depth": policy.depth, "exits": list(policy.exits), "confidence": policy.measure, "points": points}
    return curve, gens


def markdown(rec: dict[str, Any]) -> str:
    """The section of the long-text table for rows that carry a curve ('' when none does)."""
    from ...common import markdown_table

    rows = {k: r["exit_curve"] for k, r in rec["rows"].items() if "exit_curve" in r}
    if not rows:
        return ""
    parts = ["\n\n## Early exit: speed against quality\n\nTrained with CALM's weighted average of the exit layers' "
             "losses (weights proportional to the layer). Per threshold (a token exits at its first exit layer whose "
             "confidence is above it; 1 never exits): the held-out segments of the table teacher-forced through the "
             "decode path (exited states propagated to the skipped layers' keys / values; loss, layers per token and "
             "top-1 agreement with the full model), then greedy generation from held-out prompts at batch 1 (layers "
             "per generated token, consistency with the plain decode path's tokens, tokens per second; every "
             "threshold and the plain path alternate in one process; speedup against threshold 1 and against the "
             "plain path, from process CPU time, the median of the rounds)."]
    for name, c in rows.items():
        s = c["settings"]
        table = [[f"{p['threshold']:g}", f"{p['mean_layers']:.2f}", f"{p['loss']:.4f}", f"{p['agreement']:.3f}",
                  f"{p['gen_mean_layers']:.2f}", f"{p['consistency']:.3f}", f"{p['tokens_per_s']:,.0f}",
                  f"{p['speedup']:.2f}x" if p["speedup"] else "–", f"{p['vs_plain']:.2f}x"] for p in c["points"]]
        parts.append(f"\n\n`{name}`: {c['confidence']} confidence, exits after layers {c['exits']} of {c['depth']}; "
                     f"{s['prompts']} prompts of {s['prompt_len']} bytes, {s['new_tokens']} new tokens each; plain "
                     f"decode {c['plain']['tokens_per_s']:,.0f} tok/s (median of {s['rounds']} rounds).\n\n"
                     + markdown_table(["threshold", "layers (held-out)", "loss", "top-1 agreement",
                                       "layers (generation)",
                                       "consistency", "tok/s (generation)", "speedup", "vs plain decode"], table))
    return "".join(parts)


def plot(rec: dict[str, Any], out_dir: Path, name: str) -> list[str]:
    """Held-out loss against layers per token, and consistency against generation speed, per threshold."""
    from ...common import pyplot, save_figure

    rows = {k: r["exit_curve"] for k, r in rec["rows"].items() if "exit_curve" in r}
    if not rows:
        return []
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for variant, c in rows.items():
        pts = c["points"]
        left.plot([p["mean_layers"] for p in pts], [p["loss"] for p in pts], marker="o", label=variant)
        right.plot([p["tokens_per_s"] for p in pts], [p["consistency"] for p in pts], marker="o", label=variant)
        for p in pts:
            left.annotate(f"{p['threshold']:g}", (p["mean_layers"], p["loss"]), fontsize=7)
            right.annotate(f"{p['threshold']:g}", (p["tokens_per_s"], p["consistency"]), fontsize=7)
        right.axvline(c["plain"]["tokens_per_s"], color="grey", lw=0.8, ls="--", label=f"{variant}: plain decode")
    left.set_xlabel("layers per token (held-out, teacher-forced)")
    left.set_ylabel("held-out loss (nats / byte)")
    right.set_xlabel("greedy generation, tokens / s (batch 1)")
    right.set_ylabel("consistency with the full model's tokens")
    left.set_title("quality against depth used (labels: threshold)")
    right.set_title("consistency against speed")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    return save_figure(fig, out_dir, name)
