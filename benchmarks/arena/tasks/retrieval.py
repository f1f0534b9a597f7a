"""The long-text task's retrieval rows (issue 21): SPALM (Yogatama et al. 2021, arXiv:2102.02557) and
kNN-LM's domain adaptation (Khandelwal et al. 2020, arXiv:1911.00172).

`spalm`: the `xl` row's model with a tied embedding trains the first half of the budget as a plain
Transformer-XL; then a frozen copy of it (the key model) keys a datastore over every position of the text
those steps read (one entry per position: its `ffn_input` representation and the next byte; an IVF
index), and the second half trains `polyformer.memory.spalm.Spalm` (each position's k nearest entries'
next bytes, embedded with the word embedding, attended with the last layer's state and gated in) on the
text that follows, which the datastore does not hold, so no position can retrieve itself. One learning
rate schedule runs over both halves; SPALM's gate is in the optimiser from the first step (it gets no
gradient before the switch); the datastore's build counts as training time. The held-out loss is read
as the other rows' (the XL memory carried segment by segment), with the datastore of training text.

`knn_lm`: the `no_memory` row's model (the same keywords and seed: the same weights) also gets a
datastore over text of another kind it never trained on (the standard library's .txt / .rst / .html
files: licences, documentation, test data, where the model trained on its .py files) and is scored on
other files of that kind, the LM alone against p = λ p_kNN + (1 - λ) p_LM for several λ: the paper's
domain-adaptation setting.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polyformer.memory.knn_lm import KnnLM, build_datastore, interpolate
from polyformer.memory.spalm import Spalm
from polyformer.memory.vector_index import IndexSpec

from ..data import text
from ..harness import Budget, Optimiser, build_model, parameters, train
from ..variants import Variant

SPALM = dict(k=4, nlist=1024, nprobe=16, train_size=65_536)
SPALM_QUICK = dict(k=2, nlist=0, nprobe=8, train_size=4_096)          # quick: the exact (flat) index
KNN = dict(store_tokens=200_000, score_tokens=16_384, k=1024, temperature=1.0, lambdas=(0.1, 0.25, 0.5, 0.75))
KNN_QUICK = dict(store_tokens=1_000, score_tokens=128, k=8, temperature=1.0, lambdas=(0.25, 0.5))


class _Training(nn.Module):
    """What the arena optimises for the SPALM row: the net and SPALM's gate, which joins at the switch."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.gate = nn.Linear(net.attn_layers.dim, 1)
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)


def spalm_row(v: Variant, s: dict[str, Any], budget: Budget, train_text: Tensor, eval_streams: Tensor,
              evaluate: Callable[..., Tensor], log: Callable[[str], None], quick: bool) -> dict[str, Any]:
    """The SPALM row (module doc): its held-out loss by position, training figures and datastore."""
    if budget.tokens is None:
        raise ValueError("the spalm row switches to SPALM halfway through a token budget; give --budget in tokens")
    o = SPALM_QUICK if quick else SPALM
    n, b = s["segment"], s["batch"]
    net = build_model(v, num_tokens=text.VOCAB, max_seq_len=n, dim=s["dim"], depth=s["depth"], heads=s["heads"],
                      causal=True, seed=s["seed"])
    if not net.tie_embedding or not net.max_mem_len:
        raise ValueError(f"variant {v.name!r}: the spalm row needs tie_embedding=True and max_mem_len > 0")
    holder = _Training(net)
    span = len(train_text) // b
    offsets = torch.arange(b) * span
    switch = budget.tokens // (b * n) // 2
    if switch < 1 or (2 * switch + 2) * n > span:
        raise ValueError(f"the spalm row needs streams of at least {(2 * switch + 2) * n} tokens that do not wrap; "
                         f"they have {span}")
    state: dict[str, Any] = {"mems": None, "spalm": None}

    def segment(step: int) -> Tensor:
        return text.slices(train_text, offsets + step * n, n + 1)

    def begin_spalm() -> None:
        start = time.perf_counter()
        key_model = copy.deepcopy(net).eval()
        read = torch.cat([train_text[o_: o_ + switch * n + 1] for o_ in offsets.tolist()])
        spec = IndexSpec(kind="ivf", nlist=o["nlist"], nprobe=o["nprobe"], train_size=o["train_size"]) \
            if o["nlist"] else IndexSpec()
        store = build_datastore(key_model, read, key="ffn_input", spec=spec, batch_size=32)
        spalm = Spalm(net, store, key_model, k=o["k"], verify_model=False)
        spalm.gate = holder.gate             # the gate the optimiser has held from the first step
        state["spalm"] = spalm
        state["datastore"] = {"entries": len(store), "index": spec.kind, "nlist": spec.nlist, "nprobe": spec.nprobe,
                              "k": o["k"], "build_s": time.perf_counter() - start, "switch_step": switch}
        log(f"  step {switch}: datastore of {len(store):,} entries ({spec.kind}) in "
            f"{state['datastore']['build_s']:.1f} s; SPALM from here on")

    def step_loss(step: int) -> tuple[Tensor, int]:
        if step == switch:
            begin_spalm()
        seg = segment(step)
        if state["spalm"] is None:
            logits, record = net(seg[:, :-1], mems=state["mems"], return_intermediates=True)
            state["mems"] = record.mems
        else:
            logits, state["mems"] = state["spalm"].logits(seg[:, :-1], mems=state["mems"], return_mems=True)
        return F.cross_entropy(logits.transpose(1, 2), seg[:, 1:]), seg[:, 1:].numel()

    trained = train(holder, step_loss, budget, Optimiser(lr=s["lr"]), log=log)
    if state["spalm"] is None:
        raise ValueError(f"the budget ended before the switch to SPALM (step {switch})")
    spalm = state["spalm"].eval()
    per_pos = evaluate(spalm, eval_streams, n, s["warm_tokens"], read=SpalmReader(spalm))
    with torch.no_grad():
        gate = float(torch.sigmoid(holder.gate.bias))
    return {"parameters": parameters(holder), "memory_len": net.max_mem_len, "train": trained.to_json(),
            "per_pos": per_pos, "datastore": state["datastore"], "gate_bias_share": gate}


class SpalmReader:
    """Segment-by-segment SPALM logits over (b, N) streams, the XL memory carried along."""

    def __init__(self, spalm: Spalm):
        self.spalm, self.mems = spalm, None

    def __call__(self, x: Tensor) -> Tensor:
        logits, self.mems = self.spalm.logits(x, mems=self.mems, return_mems=True)
        return logits


@torch.no_grad()
def knn_domain(model: nn.Module, quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """The LM alone and kNN-LM at several λ on new-domain text, its datastore on more of that text."""
    from ...knn_lm import new_domain

    o = KNN_QUICK if quick else KNN
    store_text, score_text = new_domain()        # the stdlib's .txt / .rst / .html files, split by file name
    if len(store_text) < o["store_tokens"] or len(score_text) < o["score_tokens"]:
        raise ValueError(f"the new-domain text has {len(store_text)} + {len(score_text)} tokens; kNN-LM's row needs "
                         f"{o['store_tokens']} + {o['score_tokens']}")
    store_text, score_text = store_text[:o["store_tokens"]], score_text[-o["score_tokens"]:]
    start = time.perf_counter()
    store = build_datastore(model, store_text, key="ffn_input", batch_size=32)
    built = time.perf_counter() - start
    knn = KnnLM(model, store, lam=o["lambdas"][0], k=o["k"], temperature=o["temperature"])
    start = time.perf_counter()
    lm, near = knn.target_log_probs(score_text, batch_size=32)
    scored = time.perf_counter() - start
    losses = {f"{lam:g}": -float(interpolate(lm, near, lam).double().mean()) for lam in o["lambdas"]}
    lm_loss = -float(lm.double().mean())
    best = min(losses, key=losses.get)
    log(f"  kNN-LM on new-domain text: LM {lm_loss:.4f}, best λ {best}: {losses[best]:.4f} nats/byte")
    return {"settings": {k: list(v) if isinstance(v, tuple) else v for k, v in o.items()},
            "entries": len(store), "lm_loss": lm_loss, "knn_loss": losses, "build_s": built,
            "ms_per_token": scored / lm.numel() * 1e3}


def markdown(rec: dict[str, Any]) -> str:
    """The sections for the rows with a datastore ('' when no row has one)."""
    from ...common import markdown_table

    parts = []
    spalm = {k: r for k, r in rec["rows"].items() if "datastore" in r}
    if spalm:
        table = [[f"`{k}`", f"{r['datastore']['entries']:,}", r["datastore"]["index"], str(r["datastore"]["k"]),
                  str(r["datastore"]["switch_step"]), f"{r['datastore']['build_s']:.0f}"] for k, r in spalm.items()]
        parts.append("\n\n## SPALM's datastore\n\nTrained as Transformer-XL until the switch step, then as SPALM "
                     "with a datastore of the text read so far, keyed by a frozen copy of the model then (benchmarks/arena/"
                     "tasks/retrieval.py); the text after the switch and the held-out text are not in it. Parameters "
                     "count the trained model and the gate, not the frozen key model.\n\n"
                     + markdown_table(["variant", "entries", "index", "k", "switch step", "build s"], table))
    knn = {k: r["knn_lm"] for k, r in rec["rows"].items() if "knn_lm" in r}
    if knn:
        lams = sorted({lam for r in knn.values() for lam in r["knn_loss"]}, key=float)
        table = [[f"`{k}`", f"{r['entries']:,}", f"{r['lm_loss']:.4f}"]
                 + [f"{r['knn_loss'][lam]:.4f}" if lam in r["knn_loss"] else "–" for lam in lams]
                 + [f"{r['ms_per_token']:.2f}"] for k, r in knn.items()]
        parts.append("\n\n## kNN-LM: domain adaptation\n\nThe row's model (trained on Python code, as "
                     "`no_memory`) on text of another kind it never trained on (the standard library's .txt / .rst / .html files): a "
                     "datastore over some of those files, the loss (nats per byte) on others, the LM alone and "
                     "interpolated with λ; its table row above is the LM alone on the held-out code.\n\n"
                     + markdown_table(["variant", "datastore entries", "LM alone"] + [f"λ = {lam}" for lam in lams]
                                      + ["kNN ms / token"], table))
    return "".join(parts)
