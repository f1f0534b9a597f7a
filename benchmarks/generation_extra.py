"""The generation benchmark's further settings (batch 8, a 1k-token context) and its measure of the
default decode step's per-token overhead: the step's time less that of its matrix products alone
(the weights, in the layout the step reads them, and the attention over the cached keys), at the
benchmark's shape and the average context of its run; and the step less those products and
attentions run together in the step's order, where each attention reads its keys after the weights
streamed through the cache, as in the step (cold, about 0.2-0.3 ms more than run alone at 144 keys).
Process CPU time, paired rounds.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .common import Competitor, alternating_rounds, log, markdown_table

TARGET = {"x-transformers": 1.6, "HF GPT-2": 1.3}     # default float32 generate, batch 1 (issue 26)
INT8_TARGET = 3.0                                          # int8 weights against HF GPT-2
INT8 = "polyformer int8 weights"
SCENARIOS = {"batch 8": dict(batch=8, prompt_len=16, new=128, max_seq_len=512),
             "1k-token context": dict(batch=1, prompt_len=1008, new=128, max_seq_len=1280)}


def scenario_competitors(name: str, builders: dict[str, tuple[Callable, Callable]], batch: int, prompt_len: int,
                         new: int, max_seq_len: int) -> list[Competitor]:
    """One Competitor per library for a setting; `builders` maps a library to (make model, make run)."""
    torch.manual_seed(4321)
    prompt = torch.randint(1, 256, (batch, prompt_len))
    return [Competitor(f"{lib}, {name}", run(make(max_seq_len=max_seq_len), prompt, new), new * batch)
            for lib, (make, run) in builders.items()]


def run_scenarios(builders: dict[str, tuple[Callable, Callable]], repeats: int) -> dict[str, dict[str, float]]:
    """ms per generated token (all rows together) of each library in each setting, median of rounds."""
    out: dict[str, dict[str, float]] = {}
    for name, setting in SCENARIOS.items():
        competitors = scenario_competitors(name, builders, **setting)
        log(f"timing {name} ...")
        alternating_rounds(competitors, repeats, warmup=1, log=log)
        out[name] = {c.name.split(",")[0]: c.median_per_unit() * 1e3 for c in competitors}
    return out


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    """ms of process CPU time per call of `calls` in a row (less disturbed than wall time on a shared machine)."""
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e3


@torch.no_grad()
def step_overhead(model: torch.nn.Module, context: int, calls: int = 32, rounds: int = 7) -> dict[str, float]:
    """ms per token of the default one-token step (`generate.fast.fast_step`) on a state holding
    `context` positions, of the weight products alone (the same layout), of the attention over
    `context` cached keys alone, and what is left: the overhead. Also the products and attentions
    together in the step's order (each layer's attention reads its keys after the weights streamed
    through the cache, as in the step), and the step less that. Each round times all of them once,
    one after the other, and the medians over rounds are reported (the overheads: of each round's
    difference), so that a change in the machine's load falls on all alike."""
    from polyformer.generate import plan
    from polyformer.generate.fast import fast_step

    net = model.net
    step = fast_step(net)
    state = net.new_state(1, context + 1)
    net(torch.randint(1, 256, (1, context)), state=state)
    token = torch.tensor([[3]])

    def one_step() -> None:
        step(token, state=state)
        state.rollback(1)                 # the same context every call
    layout = plan.layout_for(net)
    k, v = state.k[:, :, :, :context + 1], state.v[:, :, :, :context + 1]
    q = torch.randn(1, k.shape[2], 1, k.shape[-1])
    scale = k.shape[-1] ** -0.5
    attentions = [lambda layer=layer: F.scaled_dot_product_attention(q, k[layer], v[layer], scale=scale)
                  for layer in range(k.shape[0])]
    products, in_order, layer = [], [], 0
    for name, m in net.named_modules():
        if isinstance(m, torch.nn.Linear):
            x = torch.randn(1, 1, m.in_features)
            products.append(lambda fn=plan.linear(m, layout), x=x: fn(x))
            in_order.append(products[-1])
            if name.endswith("project.to_qkv"):      # the layer's attention follows its q|k|v product
                in_order.append(attentions[layer])
                layer += 1

    def run(fns: list[Callable[[], Any]]) -> Callable[[], None]:
        def all_of() -> None:
            for fn in fns:
                fn()
        return all_of
    measured = {"step_ms": one_step, "weight_products_ms": run(products), "attention_ms": run(attentions),
                "products_and_attention_in_order_ms": run(in_order)}
    for fn in measured.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in measured}
    for _ in range(rounds):
        for name, fn in measured.items():
            times[name].append(_per_call(fn, calls))
    out: dict[str, float] = {"context": context}
    out.update({name: statistics.median(t) for name, t in times.items()})
    out["overhead_ms"] = statistics.median(
        s - w - a for s, w, a in zip(times["step_ms"], times["weight_products_ms"], times["attention_ms"]))
    out["overhead_in_order_ms"] = statistics.median(
        s - o for s, o in zip(times["step_ms"], times["products_and_attention_in_order_ms"]))
    return out


def extra_lines(scenarios: dict[str, dict[str, float]] | None, overhead: dict[str, float] | None) -> list[str]:
    lines: list[str] = []
    if scenarios:
        libs = list(next(iter(scenarios.values())))
        rows = [[name, *(f"{ms[lib]:.2f}" for lib in libs),
                 " / ".join(f"{ms[lib] / ms['polyformer']:.2f}x" for lib in libs if lib != "polyformer")]
                for name, ms in scenarios.items()]
        lines += ["## Other settings", "",
                  "Default generate, greedy, ms per generated token (a call's wall time / (rows x new tokens)): "
                  + "; ".join(f"{n}: batch {s['batch']}, prompt {s['prompt_len']}, {s['new']} new" for n, s in
                              SCENARIOS.items()) + ".", "",
                  markdown_table(["setting", *libs, "polyformer speedup (" + " / ".join(
                      lib for lib in libs if lib != "polyformer") + ")"], rows), ""]
    if overhead:
        lines += [f"Per-token overhead of the default decode step at {overhead['context']} cached positions "
                  f"(batch 1): the step {overhead['step_ms']:.2f} ms = weight products "
                  f"{overhead['weight_products_ms']:.2f} ms + attention over the cache "
                  f"{overhead['attention_ms']:.2f} ms + everything else "
                  f"{overhead['overhead_ms']:.2f} ms (target: under 0.5 ms). The products and attentions run "
                  f"together in the step's order (the keys read after the weights streamed through the cache) "
                  f"take {overhead['products_and_attention_in_order_ms']:.2f} ms; the step less those: "
                  f"{overhead['overhead_in_order_ms']:.2f} ms. Process CPU time, medians of paired rounds.", ""]
    return lines


def floor_note(ms: dict[str, float], anchors: list[Competitor]) -> str:
    stream = "reference: streaming the weight bytes once"
    if stream not in ms or not anchors:
        return ""
    need = min(ms[a.name] / TARGET.get(a.name, 1.0) for a in anchors)
    return (f" The targets mean {need:.2f} ms/token; reading the float32 weights once "
            f"takes {ms[stream]:.2f} ms/token on this machine" + (", so no float32 decoder can reach them here."
                                                                 if ms[stream] > need else "."))


def int8_lines(ms: dict[str, float], anchors: list[Competitor], agreement: dict[str, Any] | None) -> list[str]:
    if agreement is None or INT8 not in ms:
        return []
    vs = ", ".join(f"{a.name} {ms[a.name] / ms[INT8]:.2f}x" for a in anchors)
    first = agreement["first_divergence"]
    hf = [a.name for a in anchors if a.name == "HF GPT-2"]
    met = "" if not hf else (f" (target >= {INT8_TARGET:.0f}x HF GPT-2: "
                             + ("met" if ms[hf[0]] / ms[INT8] >= INT8_TARGET else "**not met**") + ")")
    return [f"int8 weights (`quantize_int8`, weight-only, per-row absmax; an opt-in that changes the numbers, "
            f"so it is not the float32 comparison above; float32 activations, the products on the decode "
            f"extension's int8 kernel, `rows_native.cpp`, in the native block loop): {vs} against the float32 "
            f"anchors{met}. "
            f"Against polyformer float32 on the same weights: greedy tokens "
            + (f"identical for all {agreement['tokens']}" if first is None else f"part at token {first}")
            + f"; teacher-forced top-1 agreement {agreement['teacher_forced_top1_agreement']:.1%}, "
            f"logits relative error {agreement['logits_relative_error']:.2%} (random weights: near-ties are "
            "common, a trained model's margins are larger).", ""]
