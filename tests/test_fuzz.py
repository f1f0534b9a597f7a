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
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, note, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from polyformer import (AutoregressiveWrapper, ContinuousTransformerWrapper, Decoder, Encoder,
                        TransformerWrapper, ViTransformerWrapper, XTransformer, build_model, model_config)
from polyformer.generate.decode import left_padded_positions
from polyformer.generate.fast import FastStep
from polyformer.stack import AttentionLayers
from tests.options import perturb

_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, database=None,
                          suppress_health_check=_HEALTH, print_blob=True)
settings.register_profile("slow", max_examples=int(os.environ.get("POLYFORMER_HYPOTHESIS_EXAMPLES", "2000")),
                          deadline=None, database=None, suppress_health_check=_HEALTH, print_blob=True)
PROFILE = os.environ.get("POLYFORMER_HYPOTHESIS_PROFILE", "ci")
FUZZ = settings(settings.get_profile(PROFILE))     # applied per test: other modules keep their settings

NUM_TOKENS = 16
MAX_SEQ_LEN = 12
IMAGE = 8

# ---------------------------------------------------------------------------------------------
# draws


def sometimes(values: list | tuple, p: int = 4) -> st.SearchStrategy:
    """None (keyword not given) p times out of p + 1, else one of `values`; shrinks towards None.
    One `sampled_from` per keyword keeps a draw cheap (a draw is ~60 choices)."""
    values = tuple(values)
    return st.sampled_from((None,) * (p * len(values)) + values)


TRUE = (True,)
BOOL = (True, False)

# one row per layer keyword: how often it is drawn and which values (some out of range on purpose)
LAYER_SPACE: dict[str, st.SearchStrategy] = {
    # positions
    "rotary_pos_emb": sometimes(TRUE, 3),
    "rotary_emb_dim": sometimes([2, 4, 3], 10),
    "rotary_base": sometimes([100.0, 10000.0], 8),
    "rotary_interleaved": sometimes(BOOL, 6),
    "position_infused_attn": sometimes(TRUE, 6),
    "rel_pos_bias": sometimes(TRUE, 4),
    "rel_pos_num_buckets": sometimes([4, 8, 2], 10),
    "rel_pos_max_distance": sometimes([16, 64, 3], 12),
    "alibi_pos_emb": sometimes(TRUE, 4),
    "alibi_pos_bias": sometimes(TRUE, 12),
    "alibi_num_heads": sometimes([1, 2, 3], 12),
    # norm and residual
    "pre_norm": sometimes(BOOL, 5),
    "sandwich_norm": sometimes(TRUE, 8),
    "use_scalenorm": sometimes(TRUE, 8),
    "use_rmsnorm": sometimes(TRUE, 6),
    "use_rezero": sometimes(TRUE, 8),
    "gate_residual": sometimes(TRUE, 6),
    "norm_eps": sometimes([1e-6, 1e-3], 10),
    # attention
    "attn_dim_head": sometimes([4, 8, 6, 4, 8, 6, 5], 2),
    "attn_kv_heads": sometimes([1, 2, 1, 2, 3], 4),
    "attn_one_kv_head": sometimes(TRUE, 10),
    "attn_dropout": sometimes([0.1, 0.5], 6),
    "attn_num_mem_kv": sometimes([1, 3], 4),
    "attn_sparse_topk": sometimes([1, 2, 4, 32], 6),
    "attn_use_entmax15": sometimes(TRUE, 8),
    "attn_talking_heads": sometimes(TRUE, 6),
    "attn_collab_heads": sometimes(TRUE, 8),
    "attn_collab_compression": sometimes([0.25, 0.5, 1.0], 10),
    "attn_on_attn": sometimes(TRUE, 6),
    "gate_values": sometimes(TRUE, 6),
    "attn_gate_values": sometimes(TRUE, 12),
    "attn_flash": sometimes(BOOL, 5),
    "attn_qkv_bias": sometimes(TRUE, 6),
    "attn_out_bias": sometimes(TRUE, 6),
    # sparse attention patterns (one keyword each; tests/attention/patterns holds each to its definition)
    "attn_window": sometimes([2, 3, 5], 6),
    "attn_sink_tokens": sometimes([1], 12),
    "attn_global_tokens": sometimes([1, 2], 10),
    "attn_sparse": sometimes(["strided", "fixed"], 12),
    "attn_sparse_stride": sometimes([2, 3], 12),
    "attn_block_local": sometimes([(3, 2)], 12),
    "attn_dilated": sometimes([((4, 1), (8, 2))], 14),
    # attention kernels of their own and mixers (tests/attention/kernels, tests/mixers hold each to its definition)
    "attn_linear": sometimes(["elu", "relu"], 10),
    "attn_performer": sometimes(TRUE, 10),
    "attn_performer_features": sometimes([4, 8, 0], 12),
    "attn_rfa": sometimes(TRUE, 12),
    "attn_rfa_gate": sometimes(BOOL, 12),
    "attn_fnet": sometimes(TRUE, 12),
    "attn_linformer_k": sometimes([2, 4, 0], 12),
    "attn_linformer_seq_len": sometimes([16, 32], 12),
    "attn_nystrom_landmarks": sometimes([2, 3, 0], 12),
    "gau": sometimes(TRUE, 10),
    "gau_chunk": sometimes([2, 3, 0], 10),
    # feedforward
    "ff_mult": sometimes([1, 2, 0.5], 3),
    "ff_glu": sometimes(TRUE, 4),
    "ff_relu_squared": sometimes(TRUE, 6),
    "ff_swish": sometimes(TRUE, 6),
    "ff_gelu_tanh": sometimes(TRUE, 8),
    "ff_dropout": sometimes([0.1, 0.5], 6),
    "ff_no_bias": sometimes(TRUE, 6),
    # layout
    "macaron": sometimes(TRUE, 6),
    "sandwich_coef": sometimes([1, 2], 10),
    "custom_layers": sometimes(["a", "f", "af", "fa", "aaf", "ac", "acf", "cf", "c", "fcaf", "afaf"], 8),
    "shift_tokens": sometimes([1, 2, 1, 2, (1, 0), (0, 1, 2), (1, 0, 1, 0), (2, 0, 1, 0, 0, 1)], 4),
    "residual_attn": sometimes(TRUE, 6),
    "cross_residual_attn": sometimes(TRUE, 14),
    "cross_attend": sometimes(TRUE, 6),
    "only_cross": sometimes(TRUE, 16),
    "dim_context": sometimes([8, 12], 10),
    "gradient_checkpointing": sometimes(TRUE, 8),
}

SEQ_WRAPPER_SPACE: dict[str, st.SearchStrategy] = {
    "num_memory_tokens": sometimes([1, 2], 4),
    "max_mem_len": sometimes([3, 6], 4),
    "shift_mem_down": sometimes([1, 2], 10),
    "use_abs_pos_emb": sometimes(BOOL, 4),
    "scaled_sinu_pos_emb": sometimes(TRUE, 8),
    "abs_pos_per_layer": sometimes(TRUE, 8), "randomized_pos": sometimes([20, 8], 10),    # position/
    "emb_dropout": sometimes([0.1], 8),
    "post_emb_norm": sometimes(TRUE, 6),
}
TOKEN_SPACE = {**SEQ_WRAPPER_SPACE, "emb_dim": sometimes([8, 12], 6), "tie_embedding": sometimes(TRUE, 6),
               "logits_bias": sometimes([False], 6), "embed_num_tokens": sometimes([{"token_type": 3}], 6),
               "max_cmem_len": sometimes([2, 4], 4), "cmem_ratio": sometimes([1, 2], 4)}   # memory/compressive.py
CONTINUOUS_SPACE = {**SEQ_WRAPPER_SPACE, "dim_in": sometimes([5], 3), "dim_out": sometimes([3], 3)}
VIT_SPACE = {"patch_size": st.sampled_from([2, 4, 2, 4, 3]), "channels": sometimes([1, 2], 2),
             "num_classes": sometimes([5], 2), "emb_dropout": sometimes([0.1], 8)}
XT_SPACE = {"tie_token_emb": sometimes(TRUE, 4), "num_memory_tokens": sometimes([1, 2], 5),
            "use_abs_pos_emb": sometimes(BOOL, 5), "scaled_sinu_pos_emb": sometimes(TRUE, 8)}
XT_DECODER_ONLY = ("cross_residual_attn", "custom_layers", "dim_context")
XT_NOT_GIVEN = ("cross_attend",)                      # XTransformer sets dec_cross_attend itself

WRAPPERS = ("token", "continuous", "vit", "xtransformer")
# keywords that are the same option under two spellings
ALIASES = {"alibi_pos_bias": "alibi_pos_emb", "attn_gate_values": "gate_values", "attn_one_kv_head": "attn_kv_heads"}


def keyword_dict(space: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    return st.fixed_dictionaries(space).map(lambda d: {k: v for k, v in d.items() if v is not None})


@dataclass
class Case:
    wrapper: str
    stack: str                          # "Encoder", "Decoder", "AttentionLayers"
    dim: int
    depth: int
    heads: int
    layers: dict[str, Any]
    wrap: dict[str, Any]
    batch: int
    n: int
    context_len: int
    seed: int

    def keywords(self) -> set[str]:
        """The keywords a refusal may name."""
        return {"dim", "depth", "heads", *self.layers, *self.wrap}


@st.composite
def cases(draw, wrappers: tuple[str, ...] = WRAPPERS, causal: bool | None = None) -> Case:
    wrapper = draw(st.sampled_from(wrappers))
    if wrapper == "vit":
        stack = "Encoder"
    elif wrapper == "xtransformer":
        stack = "Decoder"                       # the decoder side; the encoder side is an Encoder
    elif causal is None:
        stack = draw(st.sampled_from(["Decoder", "Encoder", "AttentionLayers"]))
    else:
        stack = "Decoder" if causal else "Encoder"
    if causal is not None and wrapper in ("vit", "xtransformer") and causal != (wrapper == "xtransformer"):
        assume(False)
    layers = draw(keyword_dict(LAYER_SPACE))
    if stack == "AttentionLayers":
        layers["causal"] = draw(st.booleans()) if causal is None else causal
    if wrapper in ("vit", "xtransformer"):
        for k in XT_NOT_GIVEN:
            layers.pop(k, None)
    space = {"token": TOKEN_SPACE, "continuous": CONTINUOUS_SPACE, "vit": VIT_SPACE, "xtransformer": XT_SPACE}[wrapper]
    wrap = draw(keyword_dict(space))
    n = draw(st.integers(2, 10))
    return Case(wrapper=wrapper, stack=stack, dim=draw(st.sampled_from([16, 24, 32])), depth=draw(st.sampled_from([1, 2])),
                heads=draw(st.sampled_from([1, 2, 4])), layers=layers, wrap=wrap,
                batch=draw(st.sampled_from([2, 1, 3])), n=n, context_len=draw(st.sampled_from([3, 5, 1, 0])),
                seed=draw(st.integers(0, 2 ** 16)))


# ---------------------------------------------------------------------------------------------
# building


STACKS = {"Encoder": Encoder, "Decoder": Decoder, "AttentionLayers": AttentionLayers}


def construct(case: Case) -> torch.nn.Module:
    """Build the drawn model through the public classes (may raise: the draw may be invalid)."""
    torch.manual_seed(case.seed)
    if case.wrapper == "xtransformer":
        enc = {f"enc_{k}": v for k, v in case.layers.items() if k not in XT_DECODER_ONLY}
        dec = {f"dec_{k}": v for k, v in case.layers.items()}
        sides = {f"{side}_{k}": v for k, v in case.wrap.items() if k != "tie_token_emb" for side in ("enc", "dec")}
        return XTransformer(dim=case.dim, tie_token_emb=case.wrap.get("tie_token_emb", False),
                            enc_num_tokens=NUM_TOKENS, enc_max_seq_len=MAX_SEQ_LEN, enc_depth=case.depth,
                            enc_heads=case.heads, dec_num_tokens=NUM_TOKENS, dec_max_seq_len=MAX_SEQ_LEN,
                            dec_depth=case.depth, dec_heads=case.heads, **enc, **dec, **sides)
    layers = STACKS[case.stack](dim=case.dim, depth=case.depth, heads=case.heads, **case.layers)
    if case.wrapper == "token":
        return TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=MAX_SEQ_LEN, attn_layers=layers, **case.wrap)
    if case.wrapper == "continuous":
        return ContinuousTransformerWrapper(max_seq_len=MAX_SEQ_LEN, attn_layers=layers, **case.wrap)
    return ViTransformerWrapper(image_size=IMAGE, attn_layers=layers, **case.wrap)


def names_keyword(message: str, keyword: str) -> bool:
    spellings = {keyword, ALIASES.get(keyword, keyword)}
    return any(re.search(rf"(?<![A-Za-z0-9_])(?:enc_|dec_)?{re.escape(s)}(?![A-Za-z0-9_])", message)
               for s in spellings)


def build(case: Case) -> torch.nn.Module:
    """The drawn model, perturbed off its initial values (ReZero / gates start as identities);
    a refused draw must be refused with a message naming a drawn keyword, and is discarded."""
    note(repr(case))
    try:
        model = construct(case)
    except (ValueError, TypeError) as err:
        message = str(err)
        named = [k for k in sorted(case.keywords()) if names_keyword(message, k)]
        assert named, f"refusal names none of the drawn keywords {sorted(case.keywords())}: {message}"
        event(f"refused: {re.sub(r'[0-9]+', 'N', message)[:90]}")
        assume(False)
    event("built")
    return perturb(model, seed=case.seed + 1, scale=0.1)


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


# ---------------------------------------------------------------------------------------------
# what the fuzzer found, kept as plain regression tests


def test_vit_refuses_a_stack_with_cross_attention():
    """Was accepted, then every forward failed: an image model has no context to give."""
    for layers in (dict(cross_attend=True), dict(only_cross=True), dict(custom_layers="acf", cross_attend=True)):
        with pytest.raises(ValueError, match="cross_attend / only_cross"):
            ViTransformerWrapper(image_size=IMAGE, patch_size=4, attn_layers=Encoder(dim=16, depth=1, **layers))


def test_xtransformer_refuses_a_decoder_context_width_other_than_dim():
    """Was accepted, then forward failed with 'context has feature size 16, expected dim_context=8'."""
    kw = dict(enc_num_tokens=8, enc_max_seq_len=8, enc_depth=1, dec_num_tokens=8, dec_max_seq_len=8, dec_depth=1)
    with pytest.raises(ValueError, match="dec_dim_context"):
        XTransformer(dim=16, dec_dim_context=8, **kw)
    XTransformer(dim=16, dec_dim_context=16, **kw)


def test_a_custom_layout_without_cross_attention_is_refused_when_cross_attend_is_set():
    """Was accepted (cross_attend silently unused); XTransformer then failed at forward ('context was
    given but the stack has no cross-attention')."""
    with pytest.raises(ValueError, match=r"cross_attend=True .*custom_layers=\('a', 'f'\)"):
        Decoder(dim=16, depth=1, cross_attend=True, custom_layers="af")
    with pytest.raises(ValueError, match="custom_layers"):
        XTransformer(dim=16, enc_num_tokens=8, enc_max_seq_len=8, enc_depth=1, dec_num_tokens=8, dec_max_seq_len=8,
                     dec_depth=1, dec_custom_layers="af")
    Decoder(dim=16, depth=1, cross_attend=True, custom_layers="acf")


def test_a_wrong_shift_tokens_tuple_names_the_keywords_that_set_the_layout():
    """The message said only '3 blocks, got 2': cross_attend, which made the third block, was not named."""
    with pytest.raises(ValueError, match=r"3 blocks \('a', 'c', 'f'\) \(from depth, .*cross_attend"):
        Decoder(dim=16, depth=1, cross_attend=True, shift_tokens=(1, 0))


def test_attn_flash_refusal_names_the_public_keyword_of_the_normaliser():
    """The message said "attn normalize='topk'", a config field, instead of attn_sparse_topk."""
    with pytest.raises(ValueError, match="attn_sparse_topk=2"):
        Encoder(dim=16, depth=1, attn_flash=True, attn_sparse_topk=2)
    with pytest.raises(ValueError, match="attn_use_entmax15=True"):
        Encoder(dim=16, depth=1, attn_flash=True, attn_use_entmax15=True)


def test_too_few_t5_buckets_names_rel_pos_bias():
    """The message named only rel_pos_num_buckets, which alone is valid: it is rel_pos_bias that uses them."""
    with pytest.raises(ValueError, match=r"rel_pos_bias=True .*rel_pos_num_buckets >= 4"):
        Encoder(dim=16, depth=1, rel_pos_bias=True, rel_pos_num_buckets=2)
    with pytest.raises(ValueError, match="rel_pos_bias is not True"):     # without rel_pos_bias: not ignored
        Encoder(dim=16, depth=1, rel_pos_num_buckets=2, rel_pos_max_distance=8)


@pytest.mark.parametrize("layout", ["f", "cf", "fcf"])
def test_a_decoder_without_self_attention_gets_a_decode_state(layout):
    """new_state raised StopIteration (it read the head sizes of the first self-attention block)."""
    torch.manual_seed(0)
    model = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=MAX_SEQ_LEN, attn_layers=Decoder(
        dim=16, depth=1, heads=2, custom_layers=layout, cross_attend="c" in layout, shift_tokens=1)).eval()
    context = torch.randn(2, 3, 16) if "c" in layout else None
    ar = AutoregressiveWrapper(model)
    prompts = torch.randint(0, NUM_TOKENS, (2, 3))
    cached = ar.generate(prompts, 5, temperature=0.0, context=context)
    assert torch.equal(cached, ar.generate(prompts, 5, temperature=0.0, context=context, cache_kv=False))


def test_generation_refuses_a_start_that_keeps_nothing():
    """A fully masked prompt row generated differently cached and uncached (see test_numerics)."""
    from polyformer import ContinuousAutoregressiveWrapper, speculative_generate

    torch.manual_seed(0)
    net = ContinuousTransformerWrapper(dim_in=4, dim_out=4, max_seq_len=8, attn_layers=Decoder(dim=16, depth=1))
    mask = torch.tensor([[True, True], [False, False]])
    with pytest.raises(ValueError, match="without any kept"):
        ContinuousAutoregressiveWrapper(net).generate(torch.randn(2, 2, 4), 3, mask=mask)
    lm = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=MAX_SEQ_LEN, attn_layers=Decoder(dim=16, depth=1)).eval()
    with pytest.raises(ValueError, match="without any kept token"):
        speculative_generate(lm, lm, torch.randint(0, NUM_TOKENS, (2, 2)), 3, mask=mask, temperature=0.0)


def test_scalar_parameters_accept_only_a_single_value():
    """PyTorch's loader takes a (1,) tensor for a 0-dim parameter (ReZero's g, ScaleNorm's g): the same
    single value, kept for old checkpoints; any other shape is named like every other mismatch."""
    model = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=MAX_SEQ_LEN,
                               attn_layers=Decoder(dim=16, depth=1, use_rezero=True))
    sd = model.state_dict()
    key = "attn_layers.blocks.0.combine.g"
    assert sd[key].ndim == 0
    model.load_state_dict({**sd, key: torch.tensor([0.5])})
    assert float(model.state_dict()[key]) == 0.5
    with pytest.raises(RuntimeError, match=f"size mismatch for {re.escape(key)}"):
        model.load_state_dict({**sd, key: torch.tensor([0.5, 0.5])})
