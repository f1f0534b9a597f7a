"""The wrappers' remaining x-transformers options (polyformer/wrap/): attention pooling against the explicit
cross-attention formula, interspersed memory tokens against the hand-built interleaved sequence, cache= with
inputs that leave out the cached ones against the uncached forward, logits and embeddings together, and the
named errors. Cached == uncached for interspersed memory tokens runs through tests/options.py."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import ContinuousTransformerWrapper, Decoder, Encoder, TransformerWrapper, ViTransformerWrapper

V, D, H, DH = 40, 16, 2, 8


def lm(stack=Decoder, seed: int = 0, layers: dict | None = None, **wrap) -> TransformerWrapper:
    torch.manual_seed(seed)
    attn_layers = stack(dim=D, depth=2, heads=H, attn_dim_head=DH, **(layers if layers is not None else
                                                                     dict(rotary_pos_emb=True)))
    return TransformerWrapper(num_tokens=V, max_seq_len=24, attn_layers=attn_layers, **wrap).eval()


def ids(b: int = 2, n: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(seed))


# attn_pool

def pooled_by_formula(model: TransformerWrapper, emb: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q kᵀ / √d) v per head through the output projection: q from the learned queries, k and v from
    the stack's output emb (b, n, dim), masked keys left out."""
    pool = model.attn_pool
    q = pool.queries @ pool.attend.project.to_q.weight.t()                          # (k, h d)
    k, v = (emb @ pool.attend.project.to_kv.weight.t()).chunk(2, dim=-1)             # (b, n, h d) each
    q = q.view(1, -1, H, DH).transpose(1, 2)
    k, v = (t.view(emb.shape[0], -1, H, DH).transpose(1, 2) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / DH ** 0.5                                     # (b, h, k, n)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(emb.shape[0], -1, H * DH)
    return out @ pool.attend.output.proj.weight.t()


def test_attn_pool_is_learned_queries_cross_attending_to_the_output():
    model = lm(Encoder, attn_pool=True, num_pooled_tokens=3).double()
    x, mask = ids(), torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    pooled = model(x, mask=mask)
    assert pooled.shape == (2, 3, D)
    assert_close(pooled, pooled_by_formula(model, model(x, mask=mask, return_embeddings=True), mask))
    y = x.clone()
    y[1, 6:] = (y[1, 6:] + 1) % V                      # masked tokens: the pooled tokens do not move
    assert_close(model(y, mask=mask), pooled)
    y[1, 2] = (y[1, 2] + 1) % V
    assert not torch.allclose(model(y, mask=mask)[1], pooled[1])
    out, record = model(x, mask=mask, return_intermediates=True)      # the logits come with the record
    assert_close(out, pooled)
    assert_close(record.logits, model(x, mask=mask, return_logits_and_embeddings=True)[0])


def test_attn_pool_deeper_is_cross_attention_blocks_each_query_on_its_own():
    model = lm(Encoder, attn_pool=True, num_pooled_tokens=3, attn_pool_depth=2, dim_pooled_tokens=12)
    x = ids()
    pooled = model(x)
    assert pooled.shape == (2, 3, 12)
    with torch.no_grad():                             # no self-attention among the queries: swapping two swaps
        model.attn_pool.queries[[0, 1]] = model.attn_pool.queries[[1, 0]].clone()
    assert_close(model(x), pooled[:, [1, 0, 2]])


def test_attn_pool_in_a_decoder_is_in_the_record_beside_the_logits():
    model, x = lm(attn_pool=True, num_pooled_tokens=2), ids()
    plain = lm()
    plain.load_state_dict(model.state_dict(), strict=False)
    logits, record = model(x, return_intermediates=True)
    assert_close(logits, plain(x))                     # the decoder's output stays its logits
    assert_close(record.attn_pooled_tokens, pooled_by_formula(model, model(x, return_embeddings=True), None))
    assert model(x, return_intermediates=True, state=model.new_state(2, 9))[1].attn_pooled_tokens is None


# memory_tokens_interspersed_every

@pytest.mark.parametrize("layers", [dict(rotary_pos_emb=True), dict()])     # rotary; learned absolute positions
def test_interspersed_memory_tokens_are_the_interleaved_sequence(layers):
    k, m = 2, 3
    model = lm(layers=layers, num_memory_tokens=k, memory_tokens_interspersed_every=m).double()
    x = ids(2, 8)
    memory = model.memory_tokens.tokens
    h = model.token_emb(x)
    if model.pos_emb is not None:                     # absolute positions at text positions, none on memory
        h = h + model.pos_emb(torch.arange(8)[None])
    parts, text_at, width = [], [], 0
    for start in range(0, 8, m):                       # k memory tokens, then the chunk's m tokens
        chunk = h[:, start:start + m]
        parts += [memory.expand(2, -1, -1), chunk]
        text_at += range(width + k, width + k + chunk.shape[1])
        width += k + chunk.shape[1]
    out = model.attn_layers(torch.cat(parts, dim=1))
    assert_close(model(x), model.to_logits(out[:, text_at]))


def test_interspersed_memory_tokens_follow_each_rows_own_positions():
    model = lm(num_memory_tokens=2, memory_tokens_interspersed_every=3)
    x = ids(1, 7)
    padded = torch.cat((ids(1, 2, seed=5), x), dim=1)  # two pad tokens in front
    mask = torch.ones(1, 9, dtype=torch.bool)
    mask[:, :2] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    batch = torch.cat((padded, ids(1, 9, seed=6)))
    out = model(batch, mask=torch.cat((mask, torch.ones_like(mask))), pos=torch.cat((pos, torch.arange(9)[None])))
    assert_close(out[0, 2:], model(x)[0])


# input_not_include_cache

def test_input_not_include_cache_runs_only_the_new_tokens():
    model, x = lm(input_not_include_cache=True, num_memory_tokens=2), ids(2, 12)
    full = model(x)
    out, record = model(x[:, :4], return_intermediates=True)
    step, record = model(x[:, 4:5], cache=record, return_intermediates=True)
    assert_close(step, full[:, 4:5])
    more, later = model(x[:, 5:9], cache=record, return_intermediates=True)
    assert_close(more, full[:, 5:9])
    again, _ = model(x[:, 5:], cache=record, return_intermediates=True)     # an older record: run again
    assert_close(again, full[:, 5:])
    assert_close(model(x[:, 9:], cache=later, return_intermediates=True)[0], full[:, 9:])
    default = lm(num_memory_tokens=2)                  # or per call
    assert_close(default(x[:, 4:], cache=default(x[:, :4], return_intermediates=True)[1],
                         input_not_include_cache=True), full[:, 4:])


def test_input_not_include_cache_keeps_the_masks_and_positions_of_the_cached_inputs():
    model, x = lm(layers=dict()), ids(2, 10)            # learned absolute positions
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :3] = False
    full = model(x, seq_start_pos=torch.tensor([3, 0]))
    _, record = model(x[:, :5], seq_start_pos=torch.tensor([3, 0]), return_intermediates=True)
    out = model(x[:, 5:], cache=record, input_not_include_cache=True)
    assert_close(out, full[:, 5:])
    assert_close(out[0], model(x[:1, 3:])[0, 2:])     # the padded row as it runs alone


def test_input_not_include_cache_on_the_continuous_wrapper():
    torch.manual_seed(0)
    model = ContinuousTransformerWrapper(dim_in=6, dim_out=5, max_seq_len=16, attn_layers=Decoder(
        dim=D, depth=1, heads=H, attn_dim_head=DH, rotary_pos_emb=True)).eval()
    x = torch.randn(2, 9, 6)
    _, record = model(x[:, :3], return_intermediates=True)
    assert_close(model(x[:, 3:], cache=record, input_not_include_cache=True), model(x)[:, 3:])


# return_logits_and_embeddings

@pytest.mark.parametrize("wrap", [{}, dict(use_cls_token=True), dict(tie_embedding=True)])
def test_return_logits_and_embeddings_gives_both(wrap):
    model, x = lm(Encoder, **wrap), ids()
    logits, emb = model(x, return_logits_and_embeddings=True)
    assert_close(emb, model(x, return_embeddings=True))
    assert_close(logits, model(x))
    assert_close(logits, model.project(emb))          # the logits are the head of those embeddings


def test_vit_return_logits_and_embeddings():
    torch.manual_seed(0)
    vit = ViTransformerWrapper(image_size=8, patch_size=4, num_classes=3,
                               attn_layers=Encoder(dim=D, depth=1, heads=H, attn_dim_head=DH)).eval()
    img = torch.randn(2, 3, 8, 8)
    logits, emb = vit(img, return_logits_and_embeddings=True)
    assert_close(emb, vit(img, return_embeddings=True))
    assert_close(logits, vit.mlp_head(emb[:, 0]))
    assert_close(logits, vit(img))


# named errors

@pytest.mark.parametrize("stack, wrap, error, match", [
    (Encoder, dict(attn_pool=True, use_cls_token=True), ValueError, "use_cls_token and attn_pool"),
    (Encoder, dict(attn_pool=True, return_only_embed=True), ValueError, "attn_pool and return_only_embed"),
    (Encoder, dict(attn_pool=True, num_pooled_tokens=0), ValueError, "num_pooled_tokens must be an integer >= 1"),
    (Encoder, dict(attn_pool=True, attn_pool_depth=0), ValueError, "attn_pool_depth must be an integer >= 1"),
    (Encoder, dict(num_pooled_tokens=2), ValueError, "give attn_pool=True"),
    (Encoder, dict(attn_pool="yes"), TypeError, "attn_pool must be True or False"),
    (Encoder, dict(num_memory_tokens=2, memory_tokens_interspersed_every=3), ValueError, "causal stack"),
    (Decoder, dict(memory_tokens_interspersed_every=3), ValueError, "give num_memory_tokens"),
    (Decoder, dict(num_memory_tokens=2, memory_tokens_interspersed_every=0), ValueError, "integer >= 1"),
    (Decoder, dict(num_memory_tokens=2, memory_tokens_interspersed_every=3, abs_pos_per_layer=True), ValueError,
     "cannot combine with abs_pos_per_layer"),
    (Decoder, dict(num_memory_tokens=2, memory_tokens_interspersed_every=3, use_cls_token=True), ValueError,
     "use_cls_token and memory_tokens_interspersed_every"),
    (Decoder, dict(input_not_include_cache=1), TypeError, "input_not_include_cache must be True or False"),
])
def test_bad_options_fail_at_build(stack, wrap, error, match):
    with pytest.raises(error, match=match):
        lm(stack, **wrap)


def test_interspersed_memory_tokens_refuse_token_shift():
    with pytest.raises(ValueError, match="cannot combine with shift_tokens"):
        lm(layers=dict(shift_tokens=1), num_memory_tokens=2, memory_tokens_interspersed_every=3)


def test_bad_forward_arguments_are_named():
    model, x = lm(), ids()
    with pytest.raises(ValueError, match="pass cache="):
        model(x, input_not_include_cache=True)
    with pytest.raises(TypeError, match="cache must be a record"):
        model(x, cache=object(), input_not_include_cache=True)
    with pytest.raises(ValueError, match="return_logits_and_embeddings gives both"):
        model(x, return_embeddings=True, return_logits_and_embeddings=True)
    with pytest.raises(ValueError, match="return_logits_and_embeddings gives both"):
        lm(return_only_embed=True)(x, return_logits_and_embeddings=True)
    spread = lm(num_memory_tokens=2, memory_tokens_interspersed_every=3)
    with pytest.raises(ValueError, match="memory_tokens_interspersed_every"):
        spread(x, prepend_embeds=torch.randn(2, 1, D))


def test_decoding_paths_that_count_text_tokens_refuse_interspersed_memory_tokens(tmp_path):
    """Speculative rollback, prompt caches and restrict_to_max_seq_len count the state's positions as text
    tokens (after the front memory tokens); interspersed ones break that count, so each refuses by name."""
    from polyformer import AutoregressiveWrapper, save_prompt_cache, speculative_generate

    model = lm(num_memory_tokens=2, memory_tokens_interspersed_every=4)
    prompt = ids(1, 6)
    with pytest.raises(ValueError, match="memory_tokens_interspersed_every"):
        speculative_generate(model, lm(), prompt, 4)
    state = model.new_state(1, 16)
    model(prompt, state=state)
    with pytest.raises(ValueError, match="memory_tokens_interspersed_every"):
        save_prompt_cache(tmp_path / "p.safetensors", model, state, prompt)
    with pytest.raises(ValueError, match="interspersed memory tokens"):
        AutoregressiveWrapper(model).generate(prompt, 24, restrict_to_max_seq_len=True)   # past max_seq_len 24


def test_speculative_and_prompt_caches_refuse_landmark_tokens(tmp_path):
    from polyformer import save_prompt_cache, speculative_generate

    model = lm(layers=dict(landmark_block=4, rotary_pos_emb=True))
    prompt = ids(1, 6)
    with pytest.raises(ValueError, match="landmark_block"):
        speculative_generate(lm(), model, prompt, 4)
    state = model.new_state(1, 16)
    model(prompt, state=state)
    with pytest.raises(ValueError, match="landmark_block"):
        save_prompt_cache(tmp_path / "p.safetensors", model, state, prompt)
