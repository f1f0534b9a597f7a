"""Reformer: logits equal Hugging Face's `ReformerModelWithLMHead` on random models of several shapes
(only LSH layers, one and several hash rounds; only local layers, one and two chunks back; local and LSH
layers mixed, each converted with its own attention options (attn_per_layer); axial and learned
positions; chunked feedforward), at lengths that are and are not multiples of the chunk
length, with and without padding, with the same rotations (hash_seed); where they differ, the
difference is pinned (Hugging Face's float32 rounding of its -1e5 self mask, its unused lm_head.bias,
its reseeding of the global RNG); decoding, the way back (to_hf), refusals by the config field's name;
and the stack's concatenated merge (reversible_merge="concat") that the converter uses."""

from __future__ import annotations

import functools
import json
import math
import shutil

import pytest
import torch

from polyformer import AutoregressiveWrapper, TransformerWrapper
from polyformer.build import build_model, model_config
from polyformer.interfaces import Source
from polyformer.interop import from_hf, load_hf, to_hf
from polyformer.interop.family import Unsupported

from .hf_models import spread, transformers

BASE = dict(vocab_size=30, hidden_size=16, num_attention_heads=2, attention_head_size=6, feed_forward_size=20,
            is_decoder=True, max_position_embeddings=32, axial_pos_shape=(4, 8), axial_pos_embds_dim=(6, 10),
            hash_seed=3, num_buckets=4, lsh_attn_chunk_length=4, local_attn_chunk_length=4, pad_token_id=0,
            eos_token_id=None)
SHAPES = {
    "lsh_one_round": dict(attn_layers=["lsh", "lsh"], num_hashes=1),
    "lsh_two_rounds": dict(attn_layers=["lsh", "lsh"], num_hashes=2, layer_norm_eps=1e-5),
    "lsh_three_rounds_learned_positions_gelu": dict(attn_layers=["lsh", "lsh", "lsh"], num_hashes=3, num_buckets=6,
                                                    lsh_attn_chunk_length=5, axial_pos_embds=False, hidden_act="gelu"),
    "local_one_chunk_back": dict(attn_layers=["local", "local"]),
    "local_two_chunks_back_chunked_ff": dict(attn_layers=["local", "local", "local"], local_num_chunks_before=2,
                                             local_attn_chunk_length=3, chunk_size_feed_forward=3),
    # the published checkpoints' mix (Hugging Face pads to the lcm of the chunk lengths: here the LSH one)
    "mixed_local_lsh": dict(attn_layers=["local", "lsh", "local", "lsh"], num_hashes=1),
    "mixed_lsh_first_two_rounds_local_two_back": dict(attn_layers=["lsh", "local", "lsh"], num_hashes=2,
                                                      local_attn_chunk_length=2, local_num_chunks_before=2,
                                                      chunk_size_feed_forward=2, layer_norm_eps=1e-5),
}
LENGTHS = [3, 4, 11, 16, 23]        # within one chunk, and multiples of it or not (Hugging Face pads those inside)
TOL = 1e-5
SELF_MASK = -32.0                   # a self-mask value whose log-sum-exp float32 holds (see the rounding test)


@functools.lru_cache(maxsize=None)
def reformer(shape: str, lm_bias: bool = False, rounding: bool = True) -> torch.nn.Module:
    """A random Hugging Face Reformer with spread weights, built without touching the global RNG.
    lm_bias=False: lm_head.bias zero (transformers 5.23 never reads it); rounding=False: its self-mask
    value moved from -1e5 to SELF_MASK (equal softmax, no float32 rounding of a lone query's weight)."""
    rng = torch.get_rng_state()
    try:
        torch.manual_seed(0)
        hf = spread(transformers.ReformerModelWithLMHead(transformers.ReformerConfig(**{**BASE, **SHAPES[shape]})))
    finally:
        torch.set_rng_state(rng)
    with torch.no_grad():
        if not lm_bias:
            hf.lm_head.bias.zero_()
        if not rounding:
            for module in hf.modules():
                if isinstance(module, transformers.models.reformer.modeling_reformer.LSHSelfAttention):
                    module.self_mask_value_float32.fill_(SELF_MASK)
    return hf


def hf_logits(hf: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Hugging Face's logits, under a saved / restored global RNG (its LSH layers reseed it)."""
    rng = torch.get_rng_state()
    try:
        with torch.no_grad():
            return hf(x, attention_mask=mask.long() if mask is not None else None).logits
    finally:
        torch.set_rng_state(rng)


def ids(n: int, b: int = 3) -> torch.Tensor:
    return torch.randint(1, BASE["vocab_size"], (b, n), generator=torch.Generator().manual_seed(n))


def padding(kind: str, n: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    mask = torch.ones(3, n, dtype=torch.bool)
    for row in (1, 2):
        cut = min(row * 2, n - 1)
        if kind == "right":
            mask[row, n - cut:] = False
        else:
            mask[row, :cut] = False
    return mask


def wraps(shape: str, n: int) -> bool:
    """Whether Hugging Face's local attention reads a chunk twice at length n: its look-back is cyclic, so
    with 2 to local_num_chunks_before chunks (after its padding to a multiple of the lcm of the chunk
    lengths, for inputs longer than the shortest) a chunk's window wraps onto itself."""
    fields = {**BASE, **SHAPES[shape]}
    kinds = set(fields["attn_layers"])
    if "local" not in kinds:
        return False
    lengths = [fields[f"{kind}_attn_chunk_length"] for kind in kinds]
    lcm = math.lcm(*lengths)
    padded = n if n <= min(lengths) or n % lcm == 0 else -(-n // lcm) * lcm
    chunks = -(-padded // fields["local_attn_chunk_length"])
    return 1 < chunks <= fields.get("local_num_chunks_before", 1)


@pytest.mark.parametrize("padded", ["none", "right", "left"])
@pytest.mark.parametrize("shape, n", [(s, n) for s in SHAPES for n in LENGTHS if not wraps(s, n)])
def test_logits_equal_hugging_face(shape, n, padded):
    hf = reformer(shape, rounding=SHAPES[shape].get("num_hashes", 1) == 1)
    model = from_hf(hf)
    x, mask = ids(n), padding(padded, n)
    theirs = hf_logits(hf, x, mask)
    with torch.no_grad():
        ours = model(x, mask=mask)
    keep = mask if mask is not None else torch.ones(x.shape, dtype=torch.bool)
    assert theirs.abs().max() > 1.0
    assert (ours - theirs)[keep].abs().max() <= TOL


def test_one_round_needs_no_change_to_hugging_face_and_several_rounds_differ_only_by_its_rounding():
    """With hash_seed's rotations, one hash round equals Hugging Face as it is (above); with several, a
    query that sees no key but its own has its own key twice in its window (the round before's last
    chunk holds it too), each at Hugging Face's self-mask score -1e5, and exp(s - logsumexp) in float32
    weighs the pair 0.9978, not 1: moving the constant to where float32 holds the log-sum-exp removes the
    whole difference."""
    x = ids(16)
    model = from_hf(reformer("lsh_two_rounds"))
    with torch.no_grad():
        ours = model(x)
    as_is = hf_logits(reformer("lsh_two_rounds"), x)
    assert (ours - as_is).abs().max() > 1e-3
    assert (ours - hf_logits(reformer("lsh_two_rounds", rounding=False), x)).abs().max() <= TOL


def test_the_rounding_touches_exactly_the_queries_that_see_only_themselves():
    """One LSH layer: Hugging Face's output equals ours at every query that sees another key; at a query
    that sees only itself, ours is its own value (the paper's rule), Hugging Face's a multiple of it
    below 1 (its -1e5 self-mask value rounded in float32)."""
    hf = reformer("lsh_two_rounds")
    layer = hf.reformer.encoder.layers[0].attention.self_attention
    attn = from_hf(hf).attn_layers.blocks[0].branch
    n, pos = 16, torch.arange(16)[None]
    h = torch.randn(2, n, 16, generator=torch.Generator().manual_seed(2))
    rng = torch.get_rng_state()
    with torch.no_grad():
        theirs = layer(h).hidden_states.view(2, n, 2, 6).transpose(1, 2)           # (b, h, n, d)
        torch.set_rng_state(rng)
        q, kv = attn.project(h, Source(x=h, pos=pos, mask=None), pos)
        found = attn.kernel(q, kv, q_pos=pos, causal=True, memory=None, need_weights=True)
    alone = found.weights.diagonal(dim1=-2, dim2=-1) == 1                       # (b, h, n)
    assert alone.any() and not alone.all()
    assert (found.out - theirs)[~alone].abs().max() <= TOL
    assert torch.equal(found.out[alone], kv.v[alone])
    own, hf_own = kv.v[alone], theirs[alone]
    factor = (hf_own * own).sum(-1) / own.pow(2).sum(-1)
    assert (hf_own - factor[:, None] * own).abs().max() <= TOL
    assert ((factor < 1 - 1e-4) & (factor > 0.99)).any()


def test_where_hugging_face_local_windows_wrap_only_the_wrapped_chunk_differs():
    """local_num_chunks_before=2, 4 tokens (padded to 2 chunks of 3): Hugging Face's second chunk sees
    chunks [1, 0, 1], its own keys twice; the first sees [0, 1, 0], each visible key twice, which changes
    no softmax. Ours sees each key once: equal on the first chunk, not on the second."""
    shape = "local_two_chunks_back_chunked_ff"
    assert wraps(shape, 4)
    hf = reformer(shape)
    x = ids(4)
    with torch.no_grad():
        diff = (from_hf(hf)(x) - hf_logits(hf, x)).abs()
    assert diff[:, :3].max() <= TOL and diff[:, 3:].max() > 1e-2


def test_transformers_5_23_never_adds_lm_head_bias():
    """ReformerOnlyLMHead (transformers 5.23) keeps lm_head.bias but its decoder has no bias (4.x linked
    them): the converted head adds the checkpoint's bias, so Hugging Face's logits are ours less it."""
    hf = reformer("local_one_chunk_back", lm_bias=True)
    model = from_hf(hf)
    assert hf.lm_head.bias.abs().min() > 0
    x = ids(11)
    with torch.no_grad():
        ours = model(x)
    assert (ours - hf.lm_head.bias - hf_logits(hf, x)).abs().max() <= TOL


def test_global_rng_is_neither_reseeded_nor_read():
    hf = reformer("lsh_two_rounds")
    model = from_hf(hf)
    x = ids(11)
    rng = torch.get_rng_state()
    try:
        torch.manual_seed(123)
        before = torch.get_rng_state()
        with torch.no_grad():
            first = model(x)
            assert torch.equal(torch.get_rng_state(), before)
            torch.manual_seed(456)
            assert torch.equal(model(x), first)
            before = torch.get_rng_state()
            hf(x)
        assert not torch.equal(torch.get_rng_state(), before)      # Hugging Face reseeds it (hash_seed)
    finally:
        torch.set_rng_state(rng)


@pytest.mark.parametrize("shape", ["local_one_chunk_back", "local_two_chunks_back_chunked_ff"])
def test_local_models_decode_with_a_state_as_without(shape):
    model = from_hf(reformer(shape))
    x = ids(14)
    with torch.no_grad():
        full = model(x)
        state = model.new_state(3, 14)
        steps = [model(x[:, :5], state=state)] + [model(x[:, t:t + 1], state=state) for t in range(5, 14)]
    assert (torch.cat(steps, 1) - full).abs().max() <= TOL


@pytest.mark.parametrize("shape", ["local_one_chunk_back", "lsh_one_round", "mixed_local_lsh"])
def test_greedy_tokens_equal_hugging_face_generate(shape):
    """A local model decodes with its state, as Hugging Face's cache; a model with LSH layers (the global
    sort moves with every token) without one, as Hugging Face's generate(use_cache=False)."""
    hf = reformer(shape)
    lsh = "lsh" in hf.config.attn_layers
    model = AutoregressiveWrapper(from_hf(hf))
    prompts = ids(6)
    ours = model.generate(prompts, 10, temperature=0.0, cache_kv=not lsh)
    rng = torch.get_rng_state()
    theirs = hf.generate(prompts, max_new_tokens=10, min_new_tokens=10, do_sample=False, use_cache=not lsh,
                         pad_token_id=0)[:, 6:]
    torch.set_rng_state(rng)
    assert torch.equal(ours, theirs), f"\nours   {ours.tolist()}\ntheirs {theirs.tolist()}"
    assert len(set(ours.flatten().tolist())) > 3


@pytest.mark.parametrize("shape", ["lsh_one_round", "mixed_local_lsh"])
def test_an_lsh_model_refuses_a_decode_state_by_name(shape):
    model = from_hf(reformer(shape))
    state = model.new_state(3, 8)
    with torch.no_grad():
        model(ids(5), state=state)
        with pytest.raises(ValueError, match="attn_lsh_global_sort"):
            model(ids(1), state=state)


@pytest.mark.parametrize("shape", SHAPES)
def test_to_hf_gives_the_same_model_back(shape):
    hf = reformer(shape)
    model = from_hf(hf)
    back = to_hf(model)
    assert type(back) is type(hf)
    kinds = hf.config.attn_layers
    kind = (("num_hashes", "num_buckets", "hash_seed", "lsh_attn_chunk_length") if "lsh" in kinds else ()) + (
        ("local_attn_chunk_length", "local_num_chunks_before") if "local" in kinds else ())
    axial = ("axial_pos_shape", "axial_pos_embds_dim") if hf.config.axial_pos_embds else ()
    for key in ("attn_layers", "axial_pos_embds", "hidden_act", "max_position_embeddings", "chunk_size_feed_forward",
                "layer_norm_eps", *kind, *axial):
        assert getattr(back.config, key) == getattr(hf.config, key), key
    theirs, ours = hf.state_dict(), back.state_dict()
    assert list(theirs) == list(ours)
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    rebuilt = build_model(model_config(model))
    rebuilt.load_state_dict(model.state_dict())
    x = ids(11)
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(x), model(x))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Hugging Face model directory (config.json, model.safetensors) of a local and an LSH model."""
    out = {}
    for shape in ("lsh_one_round", "local_one_chunk_back", "mixed_local_lsh"):
        path = tmp_path_factory.mktemp(shape)
        reformer(shape).save_pretrained(path)
        out[shape] = path
    return out


@pytest.mark.parametrize("field, value", [
    ("attn_layers", ["local", "full"]), ("local_attn_chunk_length", 3), ("num_buckets", None), ("num_buckets", [2, 2]),
    ("lsh_num_chunks_before", 2),
    ("local_num_chunks_after", 1), ("is_decoder", False), ("tie_word_embeddings", True), ("hidden_act", "tanh"),
    ("axial_pos_shape", [2, 4, 4]),
], ids=lambda v: str(v).replace(" ", ""))
def test_what_polyformer_cannot_express_is_refused_by_the_config_field(saved, tmp_path, field, value):
    shape = {"local_num_chunks_after": "local_one_chunk_back", "local_attn_chunk_length": "mixed_local_lsh"}.get(
        field, "lsh_one_round")
    config = json.loads((saved[shape] / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(saved[shape] / "model.safetensors", tmp_path / "model.safetensors")
    assert isinstance(load_hf(saved[shape]), TransformerWrapper)
    with pytest.raises(Unsupported, match=field):
        load_hf(tmp_path)
