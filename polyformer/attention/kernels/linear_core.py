"""The shared algebra of kernel attention (linear transformers, Performer, RFA): with bounded
features ψ(q), ψ(k) and a log-weight a_j per key,

    out_i = Σ_{j ≤ i} e^{a_j} (ψ(q_i)·ψ(k_j)) v_j / Σ_{j ≤ i} e^{a_j} (ψ(q_i)·ψ(k_j))

and, with a per-position log-decay d_t ≤ 0 (RFA's gate), key j's weight at query i is further
multiplied by e^{d_{j+1} + ... + d_i}. Every form below subtracts the running maximum of the key
weights seen so far (a max over j ≤ i only: the future never enters, not even through a max), so
scaled inputs cannot overflow, and they agree to rounding:

- `chunked`: the causal parallel form: quadratic inside chunks, a fixed-size summary across them,
  continuing a decode state's `Summary` (`start`) and reporting the summaries a rollback needs;
- `quadratic`: the masked (b, h, i, j) matrix, the reference and what `return_attn` shows;
- `bidirectional`: every key for every query, through one summary (`summarise`, `combine`, `read`).

The denominator gets `eps` times the largest key weight so far (feature maps that can vanish), and
is kept at least `floor` times the keys' total weight (the mass Σ_j e^{a_j}, carried beside the sums):
a feature map whose estimate of the kernel can fall below the kernel's least value (RFA's sin / cos
features: see features.Fourier) states that value, and an estimate below it is moved up to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .dense import causal_keep

# "kv" (b, h, m, dv), "k" (b, h, m), "n" (b, h), "max" (b, h): Σ e^{a_j - max} ψ(k_j) v_jᵀ,
# Σ e^{a_j - max} ψ(k_j), the keys' mass Σ e^{a_j - max}, and max
Summary = dict[str, Tensor]


def _finite(x: Tensor) -> Tensor:
    """A maximum with -inf (nothing seen yet) read as 0, so exp(a - max) stays 0 for masked keys."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def empty(q: Tensor, k: Tensor, v: Tensor) -> Summary:
    b, h, _, m = k.shape
    return {"kv": q.new_zeros(b, h, m, v.shape[-1]), "k": q.new_zeros(b, h, m), "n": q.new_zeros(b, h),
            "max": q.new_full((b, h), float("-inf"))}


def _divide(num: Tensor, den: Tensor, eps: float, floor: Tensor | None, mass: Tensor) -> Tensor:
    """num (b, h, i, dv) / den (b, h, i), den at least floor (h,) times the keys' mass (b, h, i)."""
    den = den + eps
    if floor is not None:
        den = torch.maximum(den, floor.detach()[:, None] * mass)
    return num / torch.where(den == 0, torch.ones_like(den), den)[..., None]    # no key at all: 0


def quadratic(q: Tensor, k: Tensor, a: Tensor, v: Tensor, decay: Tensor | None = None, eps: float = 0.0,
              causal: bool = True, floor: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The masked quadratic form: (out (b, h, i, dv), weights (b, h, i, j)). Causal: the last i keys are
    aligned with the queries and the j - i before them are seen by every query (undecayed)."""
    i, n = q.shape[2], k.shape[2]
    w = a[..., None, :].expand(*a.shape[:-1], i, n)                            # (b, h, i, j)
    if decay is not None:         # over the aligned keys (decay (b, h, j): the first j - i are not read)
        D = decay[..., n - i:].cumsum(-1)
        w = w + F.pad(D[..., :, None] - D[..., None, :], (n - i, 0))
    if causal:
        w = w.masked_fill(~torch.ones(i, n, dtype=torch.bool, device=q.device).tril(n - i), float("-inf"))
    top = _finite(w.amax(-1, keepdim=True))
    e = (w - top).exp()
    weights = (q @ k.transpose(-1, -2)) * e
    weights = _divide(weights, weights.sum(-1), eps, floor, e.sum(-1))
    return weights @ v, weights


def bidirectional(q: Tensor, k: Tensor, a: Tensor, v: Tensor, eps: float = 0.0, floor: Tensor | None = None
                  ) -> Tensor:
    """Every query sees every key: one summary, O(n m dv)."""
    return read(q, summarise(k, a, v), eps, floor)


def combine(first: Summary, second: Summary) -> Summary:
    """One summary of the keys of two (each relative to its own maximum)."""
    top = torch.maximum(first["max"], second["max"])
    safe = _finite(top)
    a, b = (first["max"] - safe).exp().nan_to_num(0.0), (second["max"] - safe).exp().nan_to_num(0.0)
    return {"kv": first["kv"] * a[..., None, None] + second["kv"] * b[..., None, None],
            "k": first["k"] * a[..., None] + second["k"] * b[..., None], "n": first["n"] * a + second["n"] * b,
            "max": top}


def read(q: Tensor, summary: Summary, eps: float = 0.0, floor: Tensor | None = None) -> Tensor:
    """Every query q (b, h, i, m) over the keys of one summary: (b, h, i, dv)."""
    return _divide(q @ summary["kv"], (q @ summary["k"][..., None])[..., 0], eps, floor, summary["n"][..., None])


def merge(num: Tensor, den: Tensor, mass: Tensor, top: Tensor, extra: Summary, q: Tensor
          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Add the contribution of keys every query sees (memory key / values, XL memories), summarised
    in `extra`, to per-query sums num (b, h, i, dv), den and mass (b, h, i) kept relative to maxima top
    (b, h, i)."""
    both = torch.maximum(top, extra["max"][..., None])
    safe = _finite(both)
    mine, theirs = (top - safe).exp().nan_to_num(0.0), (extra["max"][..., None] - safe).exp().nan_to_num(0.0)
    num = num * mine[..., None] + (q @ extra["kv"]) * theirs[..., None]
    den = den * mine + (q @ extra["k"][..., None])[..., 0] * theirs
    return num, den, mass * mine + extra["n"][..., None] * theirs, both


def summarise(k: Tensor, a: Tensor, v: Tensor) -> Summary:
    """Keys every query sees, as one summary (relative to their largest weight)."""
    top = a.amax(-1)
    w = (a - _finite(top)[..., None]).exp()
    kw = k * w[..., None]
    return {"kv": kw.transpose(-1, -2) @ v, "k": kw.sum(-2), "n": w.sum(-1), "max": top}


def chunked(q: Tensor, k: Tensor, a: Tensor, v: Tensor, *, decay: Tensor | None = None, start: Summary | None = None,
            chunk: int = 64, prefix: Summary | None = None, trail: int = 0, eps: float = 0.0,
            floor: Tensor | None = None) -> tuple[Tensor, Summary, Summary | None]:
    """Causal attention of aligned queries and keys q (b, h, n, m), k (b, h, n, m), a (b, h, n), v (b, h, n, dv),
    after the keys summarised in `start` (a decode state; None: none). `prefix`: keys every query sees
    but that are not carried on (memory key / values). Returns the output (b, h, n, dv), the summary
    after the last position (in its frame) and, when trail > 0, the summaries after each of the last
    `trail` positions (each tensor with a dim 2 of trail, oldest first)."""
    n = q.shape[2]
    trail = min(trail, n)
    head = n - trail
    state = start if start is not None else empty(q, k, v)
    outs = []
    if head:
        out, state = _chunks(q[..., :head, :], k[..., :head, :], a[..., :head], v[..., :head, :],
                             None if decay is None else decay[..., :head], state, chunk, prefix, eps, floor)
        outs.append(out)
    trailing = None
    if trail:
        out, states = _stepwise(q[..., head:, :], k[..., head:, :], a[..., head:], v[..., head:, :],
                                None if decay is None else decay[..., head:], state, prefix, eps, floor)
        outs.append(out)
        state = {name: x[:, :, -1] for name, x in states.items()}
        trailing = {name: x.transpose(1, 2) for name, x in states.items()}     # (b, trail, h, ...)
    return torch.cat(outs, dim=2), state, trailing


def _chunks(q: Tensor, k: Tensor, a: Tensor, v: Tensor, decay: Tensor | None, state: Summary, chunk: int,
            prefix: Summary | None, eps: float, floor: Tensor | None) -> tuple[Tensor, Summary]:
    b, h, n, m = q.shape
    L = min(chunk, n)
    C = -(-n // L)
    pad = C * L - n
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        a = F.pad(a, (0, pad), value=float("-inf"))
        decay = None if decay is None else F.pad(decay, (0, pad))
    q, k, v = (t.reshape(b, h, C, L, t.shape[-1]) for t in (q, k, v))
    a = a.reshape(b, h, C, L)
    if decay is not None:     # in the frame of each query: keys lose the decay after them
        D = decay.reshape(b, h, C, L).cumsum(-1)
        a = a - D
    run = a.cummax(-1).values                                                  # (b, h, C, L): max within the chunk
    causal = causal_keep(L, L, q.device)
    # each chunk's keys summarised relative to the chunk's own maximum, all chunks at once
    own = run[..., -1]                                                         # (b, h, C)
    e = (a - _finite(own)[..., None]).exp()
    kw = k * e[..., None]
    U_kv, U_k, U_n = kw.transpose(-1, -2) @ v, kw.sum(-2), e.sum(-1)       # (b, h, C, m, dv), (b, h, C, m), (b, h, C)
    shift = D[..., -1] if decay is not None else None
    # the carried summary before each chunk, and its maximum, in the frame of the chunk's start; the
    # loop touches (b, h, m, dv) tensors only (unbind: one backward for all chunks, not one per chunk)
    starts_kv, starts_k, starts_n, starts_max = [], [], [], []
    kv, ks, ns, top = state["kv"], state["k"], state["n"], state["max"]
    steps = zip(U_kv.unbind(2), U_k.unbind(2), U_n.unbind(2), own.unbind(2),
                shift.unbind(2) if shift is not None else [None] * C)
    for u_kv, u_k, u_n, u_max, d in steps:
        starts_kv.append(kv)
        starts_k.append(ks)
        starts_n.append(ns)
        starts_max.append(top)
        M = torch.maximum(top, u_max)                                          # frame of the chunk's last key
        safe = _finite(M)
        old, new = (top - safe).exp().nan_to_num(0.0), (u_max - safe).exp().nan_to_num(0.0)
        kv = kv * old[..., None, None] + u_kv * new[..., None, None]
        ks = ks * old[..., None] + u_k * new[..., None]
        ns = ns * old + u_n * new
        top = M if d is None else M + d      # into the frame of the next chunk's start: every key decays
    S_kv, S_k, S_n, S_max = (torch.stack(t, 2) for t in (starts_kv, starts_k, starts_n, starts_max))
    M = torch.maximum(run, S_max[..., None])                                   # (b, h, C, L) per query
    safe = _finite(M)
    # later keys masked before the exp: a decayed later key's exp can overflow, and its masked gradient 0 · inf is NaN
    w = (a[..., None, :] - safe[..., :, None]).masked_fill(~causal, float("-inf")).exp()     # (b, h, C, i, j)
    A = (q @ k.transpose(-1, -2)) * w
    scale = (S_max[..., None] - safe).exp().nan_to_num(0.0)                    # (b, h, C, L)
    num = A @ v + (q @ S_kv) * scale[..., None]
    den = A.sum(-1) + (q @ S_k[..., None])[..., 0] * scale
    mass = w.sum(-1) + S_n[..., None] * scale
    num = num.reshape(b, h, C * L, -1)[:, :, :n]
    den, mass, M = (t.reshape(b, h, C * L)[:, :, :n] for t in (den, mass, M))
    if prefix is not None:
        num, den, mass, M = merge(num, den, mass, M, prefix, q.reshape(b, h, C * L, m)[:, :, :n])
    state = {"kv": kv, "k": ks, "n": ns, "max": top}
    return _divide(num, den, eps, floor, mass), state


def _stepwise(q: Tensor, k: Tensor, a: Tensor, v: Tensor, decay: Tensor | None, state: Summary,
              prefix: Summary | None, eps: float, floor: Tensor | None) -> tuple[Tensor, Summary]:
    """A few positions one summary each (b, h, r, ...): the state after every one of them, and the
    output read from it."""
    r = q.shape[2]
    if decay is not None:
        D = decay.cumsum(-1)                                                   # (b, h, r)
        a = a - D
    run = a.cummax(-1).values
    M = torch.maximum(run, state["max"][..., None])                            # (b, h, r)
    safe = _finite(M)
    causal = causal_keep(r, r, q.device)
    w = (a[..., None, :] - safe[..., :, None]).masked_fill(~causal, float("-inf")).exp()     # (b, h, t, j)
    old = (state["max"][..., None] - safe).exp().nan_to_num(0.0)               # (b, h, t)
    kv = state["kv"][:, :, None] * old[..., None, None] + torch.einsum("bhtj,bhjm,bhjd->bhtmd", w, k, v)
    ks = state["k"][:, :, None] * old[..., None] + torch.einsum("bhtj,bhjm->bhtm", w, k)
    ns = state["n"][:, :, None] * old + w.sum(-1)
    num = torch.einsum("bhtm,bhtmd->bhtd", q, kv)
    den = torch.einsum("bhtm,bhtm->bht", q, ks)
    mass = ns
    if prefix is not None:
        num, den, mass, _ = merge(num, den, mass, M, prefix, q)
    top = M + D if decay is not None else M
    return _divide(num, den, eps, floor, mass), {"kv": kv, "k": ks, "n": ns, "max": top}
