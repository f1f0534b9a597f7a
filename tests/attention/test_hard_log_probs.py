"""return_gumbel_log_probs (attention/hard_log_probs.py): the log-probability, under the softmax of the scores, of
the key each query of a hard / Gumbel-softmax block picked; x-transformers' log_prob_from_hard_attend on the same
scores; for Gumbel draws, the frequency of each pick is that probability (the Gumbel-max trick)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import Decoder, Encoder, TransformerWrapper
from polyformer.attention.hard_attention import HardMax
from polyformer.attention.hard_log_probs import log_prob_of_pick, picking
from polyformer.attention.kernels.dense import DenseKernel
from polyformer.interfaces import KV

SMALL = dict(dim=16, heads=2, attn_dim_head=8)


def test_the_pick_s_log_probability_equals_x_transformers_on_the_same_scores():
    """HardMax inside our dense kernel, the hook's log-probability against x-transformers' Attend(hard=True)
    intermediates through its log_prob_from_hard_attend."""
    from x_transformers.attend import Attend, log_prob_from_hard_attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) * 2 for _ in range(3))
    kernel = DenseKernel(heads=4, scale=8 ** -0.5, dropout=0.0, normalize=HardMax())
    found = []
    kernel.normalize.register_forward_hook(lambda m, args, out: found.append(log_prob_of_pick(*args, out)))
    kernel(q, KV(k=k, v=v, pos=None, mask=None), mask=None, bias=None, causal=True)
    _, intermediates = Attend(hard=True, causal=True)(q, k, v)
    assert_close(found[0], log_prob_from_hard_attend(intermediates))
    assert torch.equal(found[0][..., 0], torch.zeros(2, 4))         # the first query sees one key: log 1


def test_gumbel_picks_come_with_their_probability():
    """One sequence drawn 4000 times: the last query picks key j as often as exp(log_prob) of those picks says,
    and the picks' probabilities over the keys sum to 1."""
    torch.manual_seed(0)
    model = TransformerWrapper(num_tokens=16, max_seq_len=8, attn_layers=Decoder(
        depth=1, attn_gumbel_softmax=True, **SMALL))
    x = torch.randint(0, 16, (1, 4)).expand(4000, 4)
    with torch.no_grad():
        _, record = model(x, return_gumbel_log_probs=True, return_attn=True)
    (log_probs,) = record.gumbel_log_probs                      # one picking block
    picks = record.attn[0][:, :, -1].argmax(-1)                 # (draws, heads): the last query's key
    p = torch.zeros(2, 4)
    for j in range(4):
        for h in range(2):
            chosen = log_probs[:, h, -1][picks[:, h] == j]
            assert chosen.numel() > 0 and torch.allclose(chosen, chosen[0])   # same scores: same probability
            p[h, j] = chosen[0].exp()
    freq = torch.stack([torch.bincount(picks[:, h], minlength=4) for h in range(2)]) / 4000
    assert_close(p.sum(-1), torch.ones(2))
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / 4000).sqrt() + 1e-3).all(), (freq, p)


def test_every_picking_block_reports_and_gradients_reach_the_scores():
    torch.manual_seed(0)
    layers = Encoder(depth=2, attn_hard=True, **SMALL)
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    out, record = layers(x, mask=mask, return_gumbel_log_probs=True)
    assert_close(out, layers(x, mask=mask))
    assert len(record.gumbel_log_probs) == len(picking(layers)) == 2
    for lp in record.gumbel_log_probs:
        assert lp.shape == (2, 2, 5) and (lp <= 0).all()
        assert (lp >= -torch.log(torch.tensor([[5.0], [3.0]]))[:, :, None] - 1e-6).all()   # the max of k probs
    record.gumbel_log_probs[0].sum().backward()
    assert layers.blocks[0].branch.project.to_qkv.weight.grad.abs().sum() > 0


def test_a_stack_without_picking_blocks_is_refused_by_name():
    model = TransformerWrapper(num_tokens=16, max_seq_len=8, attn_layers=Decoder(depth=1, **SMALL))
    with pytest.raises(ValueError, match="return_gumbel_log_probs .* this stack has none"):
        model(torch.randint(0, 16, (1, 4)), return_gumbel_log_probs=True)
