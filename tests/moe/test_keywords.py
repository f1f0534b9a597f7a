"""The ff_moe keywords: where experts go, what the config keeps, and bad input refused by name."""

import pytest
import torch

from polyformer import Decoder, Encoder
from polyformer.config import LayersConfig, from_dict, to_dict
from polyformer.feedforward import FeedForward
from polyformer.moe.layer import MoeFeedForward


@pytest.mark.parametrize("every, macaron, expect", [(1, False, [1, 1, 1]), (2, False, [0, 1, 0]),
                                                    (3, True, [0, 0, 1, 0, 0, 1])])
def test_experts_at_every_kth_feedforward_block(every, macaron, expect):
    stack = Encoder(dim=8, depth=3, heads=2, ff_moe=True, ff_num_experts=2, ff_moe_every=every, macaron=macaron)
    branches = [b.branch for b in stack.blocks if b.kind == "f"]
    assert [isinstance(b, MoeFeedForward) for b in branches] == [bool(e) for e in expect]
    assert all(isinstance(b, FeedForward) for b, e in zip(branches, expect) if not e)


def test_options_round_trip_through_json():
    stack = Decoder(dim=8, depth=2, heads=2, ff_moe=True, ff_num_experts=3, ff_moe_top_k=1,
                    ff_moe_capacity_factor=1.25, ff_moe_renormalize=True, ff_moe_jitter=0.01)
    cfg = from_dict(LayersConfig, to_dict(stack.cfg))
    assert cfg == stack.cfg and cfg.ff.moe.capacity_factor == 1.25 and cfg.ff.moe.renormalized
    rebuilt = Decoder.from_config(cfg)
    rebuilt.load_state_dict(stack.state_dict())
    x = torch.randn(1, 5, 8)
    assert torch.equal(rebuilt.eval()(x), stack.eval()(x))


BAD = [
    (dict(ff_moe=True, ff_num_experts=2, ff_moe_top_k=3), "ff_moe_top_k"),
    (dict(ff_moe=True, ff_num_experts=0), "ff_num_experts"),
    (dict(ff_moe=True, ff_num_experts=2.5), "ff_num_experts"),
    (dict(ff_moe=True, ff_moe_capacity_factor=0), "ff_moe_capacity_factor"),
    (dict(ff_moe=True, ff_moe_capacity_factor=-1.0), "ff_moe_capacity_factor"),
    (dict(ff_moe=True, ff_moe_capacity=0), "ff_moe_capacity"),
    (dict(ff_moe=True, ff_moe_capacity=2, ff_moe_capacity_factor=1.0), "ff_moe_capacity_factor"),
    (dict(ff_moe=True, ff_moe_balance_loss=-0.1), "ff_moe_balance_loss"),
    (dict(ff_moe=True, ff_moe_z_loss=float("nan")), "ff_moe_z_loss"),
    (dict(ff_moe=True, ff_moe_jitter=1.0), "ff_moe_jitter"),
    (dict(ff_moe=True, ff_moe_shared_experts=-1), "ff_moe_shared_experts"),
    (dict(ff_moe=True, ff_moe_every=5), "ff_moe_every"),
    (dict(ff_moe=True, ff_moe_renormalize="yes"), "ff_moe_renormalize"),
    (dict(ff_moe=True, ff_chunks=2), "ff_chunks"),
    (dict(ff_moe=True, deepnorm=True), "deepnorm"),
    (dict(ff_moe=True, ff_moe_capacity=2, universal=True), "universal"),
    (dict(ff_moe=True, ff_moe_every=2, universal=True), "shared unit of universal=True"),   # the unit has one
    (dict(ff_num_experts=4), "ff_moe=True"),
    (dict(ff_moe_top_k=1, ff_moe_capacity_factor=1.0), "ff_moe=True"),
]


@pytest.mark.parametrize("keywords, named", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_refused_when_built_naming_the_keyword(keywords, named):
    with pytest.raises(ValueError, match=named):
        Decoder(dim=8, depth=2, heads=2, **keywords)


def test_options_without_the_switch_name_both():
    with pytest.raises(ValueError, match=r"ff_moe_top_k / ff_num_experts need\(s\) ff_moe=True"):
        Encoder(dim=8, depth=1, ff_num_experts=4, ff_moe_top_k=2)
