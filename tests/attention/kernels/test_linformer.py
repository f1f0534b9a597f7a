"""Linformer (kernels/linformer.py): with k = n and E = F = identity it is softmax attention; otherwise
it is softmax attention over Eᵀ K and Fᵀ V (E's first n rows for a shorter input), padded keys count
as absent rows of E, memory key / values stay beside the projected rows, share_kv ties E and F; bad
options and a too long input are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import Decoder, Encoder, TransformerWrapper
from polyformer.attention.kernels.dense import match_heads
from polyformer.attention.kernels.linformer import Linformer, LinformerOptions
from polyformer.interfaces import KV, KernelSpec


def kernel(k: int, seq_len: int, heads: int = 2, kv_heads: int | None = None, d: int = 8, dropout: float = 0.0,
           share_kv: bool = False) -> Linformer:
    torch.manual_seed(0)
    return Linformer(KernelSpec(heads=heads, kv_heads=kv_heads or heads, dim_qk=d, dim_v=d, causal=False, layer=0,
                                scale=d ** -0.5, dropout=dropout, options=LinformerOptions(k, seq_len, share_kv)))


def run(attn: Linformer, q, keys, values, mask=None, free=0, need_weights=False):
    pos = torch.arange(keys.shape[2] - free)[None]
    return attn(q, KV(keys, values, pos, mask, free), q_pos=pos[:, -q.shape[2]:], causal=False, memory=None,
                need_weights=need_weights).out


def qkv(b=2, h=2, n=12, d=8, hk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, n, d, generator=g), torch.randn(b, hk or h, n, d, generator=g),
            torch.randn(b, hk or h, n, d, generator=g))


def projected(q, k, v, e, f, free_k=None, free_v=None):
    """softmax(q (Eᵀ K)ᵀ / √d) Fᵀ V, written out (with keys that are not projected first)."""
    k, v = torch.einsum("bhjd,jr->bhrd", k, e), torch.einsum("bhjd,jr->bhrd", v, f)
    if free_k is not None:
        k, v = torch.cat((free_k, k), 2), torch.cat((free_v, v), 2)
    return F.scaled_dot_product_attention(q, k, v)


def test_identity_projections_of_full_length_are_softmax_attention():
    attn = kernel(12, 12)
    with torch.no_grad():
        attn.proj_k.copy_(torch.eye(12))
        attn.proj_v.copy_(torch.eye(12))
    q, k, v = qkv()
    assert_close(run(attn, q, k, v), F.scaled_dot_product_attention(q, k, v), atol=1e-6, rtol=1e-5)


def test_a_shorter_input_uses_the_first_rows():
    attn = kernel(4, 32)
    q, k, v = qkv()
    ref = projected(q, k, v, attn.proj_k[:12], attn.proj_v[:12])
    assert_close(run(attn, q, k, v), ref)


def test_share_kv_ties_e_and_f():
    attn = kernel(4, 16, share_kv=True)
    assert [name for name, _ in attn.named_parameters()] == ["proj_k"]
    q, k, v = qkv()
    assert_close(run(attn, q, k, v), projected(q, k, v, attn.proj_k[:12], attn.proj_k[:12]))
    sizes = [sum(p.numel() for p in Encoder(dim=16, depth=1, heads=2, attn_linformer_k=4, attn_linformer_seq_len=16,
                                            attn_linformer_share_kv=share).parameters()) for share in (False, True)]
    assert sizes[0] - sizes[1] == 16 * 4


def test_padded_keys_are_absent_rows():
    """Zeroed before the projection, a padded key is as if it and its row of E were not there."""
    attn = kernel(4, 16)
    q, k, v = qkv()
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, 9:] = False
    mask[1, 3:5] = False
    out = run(attn, q, k, v, mask)
    for b in range(2):
        keep = mask[b]
        ref = projected(q[b:b + 1], k[b:b + 1, :, keep], v[b:b + 1, :, keep], attn.proj_k[:12][keep],
                        attn.proj_v[:12][keep])
        assert_close(out[b:b + 1], ref)
    none = torch.zeros_like(mask)
    assert torch.equal(run(attn, q, k, v, none), torch.zeros_like(out))


def test_memory_key_values_stay_beside_the_projected_rows():
    attn = kernel(4, 12)
    q, k, v = qkv()
    mem_k, mem_v = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    out = run(attn, q, torch.cat((mem_k, k), 2), torch.cat((mem_v, v), 2), free=3)
    assert_close(out, projected(q, k, v, attn.proj_k, attn.proj_v, mem_k, mem_v))


def test_grouped_kv_heads_equal_repeated_heads():
    q, k, v = qkv(h=4, hk=2)
    grouped = run(kernel(4, 16, heads=4, kv_heads=2), q, k, v)
    assert_close(grouped, run(kernel(4, 16, heads=4), q, match_heads(k, 4), match_heads(v, 4)))


def test_dropout_acts_on_the_projected_weights_in_training_only():
    attn = kernel(4, 16, dropout=0.5)
    q, k, v = qkv()
    assert not torch.allclose(run(attn.train(), q, k, v), run(attn, q, k, v))
    assert torch.equal(run(attn.eval(), q, k, v), run(attn, q, k, v))


def test_a_longer_input_is_refused_by_name():
    model = TransformerWrapper(num_tokens=20, max_seq_len=32, attn_layers=Encoder(
        dim=16, depth=1, heads=2, attn_linformer_k=4, attn_linformer_seq_len=8))
    model(torch.randint(0, 20, (1, 8)))
    with pytest.raises(ValueError, match="attn_linformer_seq_len=8"):
        model(torch.randint(0, 20, (1, 9)))


def test_weights_are_refused_by_name():
    model = TransformerWrapper(num_tokens=20, max_seq_len=8, attn_layers=Encoder(
        dim=16, depth=1, heads=2, attn_linformer_k=4, attn_linformer_seq_len=8))
    with pytest.raises(ValueError, match="return_attn.*attn_linformer_k"):
        model(torch.randint(0, 20, (1, 8)), return_attn=True)


@pytest.mark.parametrize("keywords, named", [
    (dict(attn_linformer_k=0, attn_linformer_seq_len=8), "attn_linformer_k"),
    (dict(attn_linformer_k=4, attn_linformer_seq_len=0), "attn_linformer_seq_len"),
    (dict(attn_linformer_k="4", attn_linformer_seq_len=8), "attn_linformer_k"),
    (dict(attn_linformer_k=4, attn_linformer_seq_len=8, attn_linformer_share_kv=1), "attn_linformer_share_kv"),
    (dict(attn_linformer_k=4), "attn_linformer_seq_len"),
])
def test_bad_options_are_refused_by_name(keywords, named):
    with pytest.raises(ValueError, match=named):
        Encoder(dim=16, depth=1, heads=2, **keywords)


def test_a_decoder_is_refused():
    with pytest.raises(ValueError, match="attn_linformer_k.*cannot be causal"):
        Decoder(dim=16, depth=1, heads=2, attn_linformer_k=4, attn_linformer_seq_len=8)
