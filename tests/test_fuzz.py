"""Random valid configurations through the same properties (issue 7).

A draw is plain data: a wrapper (token, continuous, ViT, encoder-decoder), a stack class and
keyword dicts over the keyword table — positions x norm x residual x attention x feedforward x
layout x memory / XL. Each draw is built through the public classes. A draw the library refuses
must be refused at construction with a `ValueError` / `TypeError` that names a drawn keyword; it is
then discarded. Every built model must then run, and keep the properties below.

Profiles: "ci" (default; few examples, derandomized so CI is reproducible) and "slow"
(`POLYFORMER_HYPOTHESIS_PROFILE=slow`, `POLYFORMER_HYPOTHESIS_EXAMPLES` per property, 2000 unless
set). Run with `--hypothesis-show-statistics` to see how many draws were tried and refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, note, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from polyformer import (AutoregressiveWrapper, TransformerWrapper, ViTransformerWrapper, XTransformer, build_model,
                        model_config)
from polyformer.generate.decode import left_padded_positions
from polyformer.generate.fast import FastStep
from tests.fuzz_space import IMAGE, NUM_TOKENS, Case, build, cases, construct, names_keyword

_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, database=None,
                          suppress_health_check=_HEALTH, print_blob=True)
settings.register_profile("slow", max_examples=int(os.environ.get("POLYFORMER_HYPOTHESIS_EXAMPLES", "2000")),
                          deadline=None, database=None, suppress_health_check=_HEALTH, print_blob=True)
PROFILE = os.environ.get("POLYFORMER_HYPOTHESIS_PROFILE", "ci")
FUZZ = settings(settings.get_profile(PROFILE))     # applied per test: other modules keep their settings


# ---------------------------------------------------------------------------------------------
# inputs and one forward per wrapper kind


@dataclass
class Inputs:
    x: torch.Tensor                     # ids (b, n), vectors (b, n, d), images, or src ids (XTransformer)
    mask: torch.Tensor | None = None    # (b, n) padding of x
    context: torch.Tensor | None = None
    context_mask: torch.Tensor | None = None
    tgt: torch.Tensor | None = None     # XTransformer decoder input


def make_inputs(case: Case, model: torch.nn.Module, masked: bool = True, seed: int = 0) -> Inputs:
    g = torch.Generator().manual_seed(case.seed + seed)
    b, n = case.batch, case.n
    mask = torch.rand(b, n, generator=g) > 0.25
    if masked:
        mask[:, -1] = True                          # every row keeps at least one position
    else:
        mask = None
    if case.wrapper == "vit":
        channels = case.wrap.get("channels", 3)
        return Inputs(torch.randn(b, channels, IMAGE, IMAGE, generator=g))
    if case.wrapper == "xtransformer":
        return Inputs(torch.randint(0, NUM_TOKENS, (b, n), generator=g), mask=mask,
                      tgt=torch.randint(0, NUM_TOKENS, (b, n), generator=g))
    if case.wrapper == "token":       # distinct ids: equal keys would make top-k ties (see test_cached_...)
        x = torch.stack([torch.randperm(NUM_TOKENS, generator=g)[:n] for _ in range(b)])
    else:
        x = torch.randn(b, n, model.dim_in, generator=g)
    inp = Inputs(x, mask=mask)
    stack = model.attn_layers
    if stack.has_cross:
        m = case.context_len
        inp.context = torch.randn(b, m, stack.cfg.dim_context or stack.dim, generator=g)
        if masked:
            inp.context_mask = torch.rand(b, m, generator=g) > 0.3
    return inp


def run(model: torch.nn.Module, inp: Inputs, **kwargs: Any) -> torch.Tensor:
    """The model's float output: logits, vectors, class logits / patches, decoder logits."""
    if isinstance(model, XTransformer):
        enc = model.encoder(inp.x, mask=inp.mask, return_embeddings=True)
        return model.decoder.net(inp.tgt, context=enc, context_mask=inp.mask, **kwargs)
    if isinstance(model, ViTransformerWrapper):
        return model(inp.x)
    return model(inp.x, mask=inp.mask, context=inp.context, context_mask=inp.context_mask, **kwargs)


def replaced(x: torch.Tensor, where: torch.Tensor, seed: int = 7) -> torch.Tensor:
    """x with the positions `where` (b, n) given other values (token ids or vectors)."""
    g = torch.Generator().manual_seed(seed)
    if x.dtype.is_floating_point:
        other = torch.randn(x.shape, generator=g)
        return torch.where(where[..., None], other, x)
    other = (x + torch.randint(1, NUM_TOKENS, x.shape, generator=g)) % NUM_TOKENS
    return torch.where(where, other, x)


# ---------------------------------------------------------------------------------------------
# properties


@FUZZ
@given(case=cases())
def test_forward_and_backward_are_finite(case):
    model = build(case).train()
    inp = make_inputs(case, model)
    if isinstance(model, XTransformer):
        out = model(inp.x, inp.tgt, src_mask=inp.mask)
    else:
        out = run(model, inp)
        if getattr(model, "max_mem_len", 0):            # a second segment reads the first one's memories
            _, mems = run(model, inp, return_mems=True)
            out = out + run(model, inp, mems=mems)
    assert torch.isfinite(out).all()
    out.float().square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"


@FUZZ
@given(case=cases(wrappers=("token", "continuous", "xtransformer"), causal=True), cut=st.integers(0, 8))
def test_decoders_are_causal(case, cut):
    model = build(case).eval()
    inp = make_inputs(case, model)
    t = min(cut, case.n - 2)                    # positions <= t are kept, the rest change
    future = torch.zeros(case.batch, case.n, dtype=torch.bool)
    future[:, t + 1:] = True
    changed = Inputs(**vars(inp))
    if isinstance(model, XTransformer):
        changed.tgt = replaced(inp.tgt, future)
    else:
        changed.x = replaced(inp.x, future)
    assert_close(run(model, changed)[:, :t + 1], run(model, inp)[:, :t + 1])


@FUZZ
@given(case=cases(wrappers=("token", "continuous", "xtransformer")))
def test_kept_positions_ignore_masked_ones(case):
    model = build(case).eval()
    inp = make_inputs(case, model)
    assume(not bool(inp.mask.all()) or inp.context_mask is not None)
    changed = Inputs(**vars(inp))
    changed.x = replaced(inp.x, ~inp.mask)
    if inp.context_mask is not None:
        changed.context = replaced(inp.context, ~inp.context_mask)
    out, out_changed = run(model, inp), run(model, changed)
    if isinstance(model, XTransformer):         # src padding: every decoder position ignores it
        assert_close(out_changed, out)
    else:
        assert_close(out_changed[inp.mask], out[inp.mask])


@FUZZ
@given(case=cases(wrappers=("token", "continuous", "xtransformer"), causal=True), split=st.integers(1, 9))
def test_cached_decoding_equals_uncached(case, split):
    model = build(case).eval()
    # top-k selection is discontinuous: without positions, a repeated token gives keys equal up to
    # rounding, and cached / uncached rounding may then pick different keys
    net = model.decoder.net if isinstance(model, XTransformer) else model
    tie_free = net.pos_emb is not None or net.attn_layers.has_pos_emb or "attn_sparse_topk" not in case.layers
    if isinstance(model, XTransformer):
        assume(tie_free)
        src = make_inputs(case, model)
        start = src.tgt[:, :2]
        cached = model.generate(src.x, start, 4, src_mask=src.mask, temperature=0.0)
        uncached = model.generate(src.x, start, 4, src_mask=src.mask, temperature=0.0, cache_kv=False)
        assert torch.equal(cached, uncached)
        return
    inp = make_inputs(case, model, masked=False)
    n = case.n
    mask = torch.ones(case.batch, n, dtype=torch.bool)
    mask[0, : n // 3] = False                             # row 0: a shorter, left-padded prompt
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    extra = dict(context=inp.context, context_mask=inp.context_mask)
    full = model(inp.x, mask=mask, pos=pos, **extra)
    state = model.new_state(case.batch, n)
    s = max(min(split, n - 1), n // 3 + 1)                # every row keeps a token of the first chunk
    chunks = [model(inp.x[:, :s], mask=mask[:, :s], pos=pos[:, :s], state=state, **extra)]
    chunks += [model(inp.x[:, t:t + 1], state=state, **extra) for t in range(s, min(s + 2, n))]
    if s + 2 < n:
        chunks.append(model(inp.x[:, s + 2:], state=state, **extra))     # several positions at once
    cached = torch.cat(chunks, dim=1)
    assert_close(cached[mask], full[mask], atol=1e-4, rtol=1e-4)
    if isinstance(model, TransformerWrapper) and tie_free:
        ar = AutoregressiveWrapper(model)
        prompts = inp.x[:, : max(n // 3 + 1, n - 4)]
        kwargs = dict(mask=mask[:, : prompts.shape[1]], temperature=0.0, **extra)
        assert torch.equal(ar.generate(prompts, 4, **kwargs), ar.generate(prompts, 4, cache_kv=False, **kwargs))


@FUZZ
@given(case=cases(wrappers=("token",), causal=True), split=st.integers(1, 9))
def test_fast_decode_step_is_bit_identical_to_the_module_step(case, split):
    """The flat one-token step generation uses (`generate.fast`) against the module tree's step,
    on the same state; a configuration it does not cover must say why."""
    model = build(case).eval()
    reason = FastStep.unsupported(model)
    event(f"fast step: {reason or 'covered'}")
    if reason is not None or model.attn_layers.has_cross:
        assert reason                                     # cross-attention stacks are never covered
        return
    inp = make_inputs(case, model, masked=False)
    n = case.n
    assume(n >= 3)
    mask = torch.ones(case.batch, n, dtype=torch.bool)
    mask[0, : n // 3] = False
    pos = left_padded_positions(mask)
    s = max(min(split, n - 2), n // 3 + 1)
    states = []
    for _ in range(2):
        states.append(model.new_state(case.batch, n))
        with torch.no_grad():
            model(inp.x[:, :s], mask=mask[:, :s], pos=pos[:, :s], state=states[-1])
    step = FastStep(model)
    with torch.no_grad():
        for t in range(s, n):
            token = inp.x[:, t:t + 1]
            assert torch.equal(step(token, state=states[1]), model(token, state=states[0]))


@FUZZ
@given(case=cases())
def test_same_seed_same_outputs(case):
    a, b = build(case), build(case)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    inp = make_inputs(case, a)
    a.train(), b.train()                           # dropout too is seeded
    torch.manual_seed(11)
    out_a = run(a, inp)
    torch.manual_seed(11)
    out_b = run(b, inp)
    assert_close(out_a, out_b, rtol=0, atol=0)


@FUZZ
@given(case=cases())
def test_state_dict_into_model_rebuilt_from_saved_config(case):
    model = build(case).eval()
    saved = json.loads(json.dumps(model_config(model)))
    torch.manual_seed(case.seed + 99)              # a different init: the weights must carry everything
    rebuilt = build_model(saved).eval()
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    inp = make_inputs(case, model)
    assert_close(run(rebuilt, inp), run(model, inp), rtol=0, atol=0)


@FUZZ
@given(case=cases(wrappers=("token", "continuous", "vit")), data=st.data())
def test_bad_state_dict_names_every_mismatch_at_once(case, data):
    model = build(case)
    sd = model.state_dict()
    keys = sorted(sd)
    missing = data.draw(st.lists(st.sampled_from(keys), max_size=3, unique=True), label="missing")
    rest = [k for k in keys if k not in missing and sd[k].ndim >= 1]
    misshapen = data.draw(st.lists(st.sampled_from(rest), max_size=3, unique=True) if rest else st.just([]),
                          label="misshapen")
    unexpected = data.draw(st.lists(st.sampled_from(["extra.weight", "attn_layers.blocks.99.bias", "head.w"]),
                                    max_size=2, unique=True), label="unexpected")
    assume(missing or misshapen or unexpected)
    bad = {k: v for k, v in sd.items() if k not in missing}
    for k in misshapen:
        bad[k] = torch.zeros(*sd[k].shape[:-1], sd[k].shape[-1] + 1)
    for k in unexpected:
        bad[k] = torch.zeros(2)
    with pytest.raises(RuntimeError) as err:
        model.load_state_dict(bad)
    message = str(err.value)
    for k in missing + misshapen + unexpected:
        assert f'"{k}"' in message or f"for {k}:" in message, f"{k} is not named in: {message}"


@FUZZ
@given(case=cases())
def test_refusals_name_every_keyword_that_alone_fixes_the_draw(case):
    """A refused draw names each keyword whose removal alone makes the draw valid (both sides of a
    pairwise conflict); an accepted draw runs."""
    note(repr(case))
    try:
        model = construct(case)
    except (ValueError, TypeError) as err:
        message = str(err)
        culprits = []
        for key in sorted(set(case.layers) | set(case.wrap)):
            if key == "causal":
                continue
            fewer = Case(**{**vars(case), "layers": {k: v for k, v in case.layers.items() if k != key},
                            "wrap": {k: v for k, v in case.wrap.items() if k != key}})
            try:
                construct(fewer)
            except (ValueError, TypeError):
                continue
            culprits.append(key)
        event(f"refused, {len(culprits)} culprit(s)")
        for key in culprits:
            assert names_keyword(message, key), f"{key!r} alone makes the draw valid but is not named: {message}"
        return
    event("built")
    model.eval()
    run(model, make_inputs(case, model))
