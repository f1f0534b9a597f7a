"""x-transformers 2.x stack policies (stack_policies.py, stack_order.py, attention/value_residual.py), each by
its defining property: weight tying and execution orders equal untied stacks holding the same weights; PAR and
U-Net layouts equal x-transformers' own; stochastic depth runs a subset of whole blocks in training only; the
reinjected input and the value residual against their formulas; context token dropout keeps a random share
of each row's tokens; causality; bad values named. Cache parity: tests/options.py."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from polyformer import CrossAttender, Decoder, Encoder, TransformerWrapper
from polyformer.config import from_dict, to_dict, LayersConfig
from polyformer.interfaces import Context, Source
from polyformer.stack_policies import drop_context
from tests.helpers import WRAPPER_KEYS
from tests.options import KERNEL_OPTIONS, perturb

DIM, N = 16, 7
POLICIES = ("weight_tie_layers", "layers_execute_order", "par_ratio", "unet_skips", "reinject_input",
            "add_value_residual", "add_value_residual_fixed", "layer_dropout")


def layer_keywords(name: str) -> dict:
    if name == "layer_dropout":                   # training only: kept out of the contracts' option table
        return dict(layer_dropout=(0.3, 0.0, 0.5, 0.1), rotary_pos_emb=True)
    return {k: v for k, v in KERNEL_OPTIONS[name].items() if k not in WRAPPER_KEYS}


def make(cls=Decoder, seed: int = 0, **keywords) -> torch.nn.Module:
    torch.manual_seed(seed)
    keywords = {"depth": 2, **keywords}
    return perturb(cls(dim=DIM, heads=2, attn_dim_head=8, **keywords), seed + 1).eval()


def ctx_of(n: int, causal: bool = True) -> Context:
    return Context(pos=torch.arange(n)[None], causal=causal)


def untied(model: torch.nn.Module, order: list[int], **keywords) -> torch.nn.Module:
    """A stack of custom_layers whose block j holds the weights of model's block order[j]."""
    kinds = [model.blocks[i].kind for i in order]
    ref = Decoder(dim=DIM, heads=2, attn_dim_head=8, custom_layers=kinds, **keywords).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("blocks.")}
    for j, i in enumerate(order):
        state |= {f"blocks.{j}.{k}": v for k, v in model.blocks[i].state_dict().items()}
    ref.load_state_dict(state)
    return ref


def test_weight_tie_layers_is_one_unit_applied_depth_times():
    tied = make(depth=3, weight_tie_layers=True, rotary_pos_emb=True)
    assert tied.cfg.universal and len(tied.blocks) == 2
    assert sum(p.numel() for p in tied.parameters()) == sum(p.numel() for p in make(depth=1).parameters())
    x = torch.randn(2, N, DIM)
    assert_close(tied(x), untied(tied, [0, 1] * 3, rotary_pos_emb=True)(x))


def test_layers_execute_order_readme_block_equals_untied_stack_with_xl_memories():
    # the README's block: 3 sets of attention and feedforward, each run 4 times before the next; no depth
    order = (*((0, 1) * 4), *((2, 3) * 4), *((4, 5) * 4))
    torch.manual_seed(0)
    model = perturb(Decoder(dim=DIM, heads=2, attn_dim_head=8, custom_layers=("a", "f") * 3,
                            layers_execute_order=order), 1).eval()
    assert len(model.blocks) == 6 and model.num_self_attn == 12
    ref = untied(model, list(order))
    x = torch.randn(2, N, DIM)
    mems = [torch.randn(2, 3, DIM) for _ in range(12)]
    out, rec = model(x, mems=mems, return_intermediates=True)
    want, rec_ref = ref(x, mems=mems, return_intermediates=True)
    assert_close(out, want)
    assert len(rec.mems) == 12
    for a, b in zip(rec.mems, rec_ref.mems):
        assert_close(a, b)


def test_readme_layers_execute_order_in_a_wrapper_needs_no_depth():
    model = TransformerWrapper(num_tokens=50, max_seq_len=16, attn_layers=Decoder(
        dim=DIM, heads=2, custom_layers=("a", "f", "a", "f", "a", "f"),
        layers_execute_order=(*((0, 1) * 4), *((2, 3) * 4), *((4, 5) * 4))))
    assert model.attn_layers.num_self_attn == 12                    # each run of a block is a layer of its own
    assert model(torch.randint(0, 50, (1, 9))).shape == (1, 9, 50)


@pytest.mark.parametrize("depth, ratio, cross", [(6, 2, False), (6, 4, False), (8, 3, False), (6, 3, True),
                                                 (12, 6, False)])
def test_par_ratio_layout_equals_x_transformers(depth, ratio, cross):
    x_transformers = pytest.importorskip("x_transformers")
    theirs = x_transformers.Decoder(dim=DIM, depth=depth, heads=2, par_ratio=ratio, cross_attend=cross)
    ours = Decoder(dim=DIM, depth=depth, heads=2, par_ratio=ratio, cross_attend=cross)
    assert ours.cfg.layout == tuple(theirs.layer_types)
    assert ours.cfg.layout.count("a") == depth * (3 if cross else 2) // ratio


@pytest.mark.parametrize("depth, cross", [(4, False), (5, False), (6, False), (3, True)])
def test_unet_skips_pair_the_units_as_x_transformers(depth, cross):
    x_transformers = pytest.importorskip("x_transformers")
    theirs = x_transformers.Decoder(dim=DIM, depth=depth, heads=2, unet_skips=True, cross_attend=cross)
    expected = {i: c.prev_layer_ind for i, c in enumerate(theirs.skip_combines) if c is not None}
    ours = Decoder(dim=DIM, depth=depth, heads=2, unet_skips=True, cross_attend=cross)
    u = len(ours.cfg.layout) // depth
    assert {e: k * u for e, k in ours.loop.pairs.items()} == expected


def test_unet_skips_formula_and_identity_skip():
    model = make(depth=4, unet_skips=True)
    x = torch.randn(2, N, DIM)
    ctx, h, saved = ctx_of(N), x, []
    pairs = {4: 1, 6: 0}                         # units 2 and 3 start from [x_1 ; x] and [x_0 ; x]
    for e, block in enumerate(model.blocks):
        if e % 2 == 0:
            saved.append(h)
        if e in pairs:
            h = torch.cat((saved[pairs[e]], h), -1) @ model.loop.combines[str(e)].weight.T
        h = block(h, ctx, None)[0]
    assert_close(model(x), model.final_norm(h))
    with torch.no_grad():                         # W = [0 | I]: no skip at all
        for c in model.loop.combines.values():
            c.weight.copy_(torch.cat((torch.zeros(DIM, DIM), torch.eye(DIM)), 1))
    plain = Decoder(dim=DIM, depth=4, heads=2, attn_dim_head=8).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    assert_close(model(x), plain(x))


def test_layer_dropout_skips_whole_blocks_in_training_only():
    model = make(depth=3, layer_dropout=0.5)
    plain = make(depth=3)
    x = torch.randn(2, N, DIM)
    assert_close(model(x), plain(x))                                  # eval: every block runs
    ran: list[int] = []
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, a, out, i=i: ran.append(i))
    model.train()
    torch.manual_seed(3)
    seen = torch.zeros(len(model.blocks))
    for trial in range(60):
        ran.clear()
        out = model(x)
        seen[ran] += 1
        if trial < 4:                                                 # equals the stack of the blocks that ran
            subset = untied(model, ran) if ran else None
            want = subset(x) if subset is not None else model.final_norm(x)
            assert_close(out, want)
    assert ((seen > 15) & (seen < 45)).all()                          # each block dropped about half the time
    model.layer_drop.p = (1.0,) * 6
    assert_close(model(x), model.final_norm(x))
    state = model.new_state(2, N)
    with pytest.raises(ValueError, match="layer_dropout"):
        model(x[:, :3], state=state)


def test_reinject_input_formula_gate_and_zero_projection():
    model = make(reinject_input=True, learned_reinject_input_gate=True)
    x = torch.randn(2, N, DIM)
    inject = (x @ model.reinject.proj.weight.T) * torch.sigmoid(x @ model.reinject.gate.weight.T)
    ctx, h = ctx_of(N), x
    for block in model.blocks:
        branch_in = block.norm_in(h + inject)                        # the branch reads h + W x0; the stream h
        y = block.branch(branch_in, ctx, None).out if block.kind == "a" else block.branch(branch_in)
        h = block.join(h, y)
    assert_close(model(x), model.final_norm(h))
    with torch.no_grad():
        model.reinject.proj.weight.zero_()
    plain = make()
    plain.load_state_dict(model.state_dict(), strict=False)
    assert_close(model(x), plain(x))


def test_reinject_input_reaches_the_rows_act_runs_on_their_own(monkeypatch):
    """ACT runs the rows still pondering apart (act.rows_of): each keeps its own W x0, so the batch equals each
    row alone."""
    from polyformer import act

    calls, rows_of = [], act.rows_of
    monkeypatch.setattr(act, "rows_of", lambda ctx, rows: calls.append(rows) or rows_of(ctx, rows))
    model = make(depth=1, universal=True, act=True, act_max_steps=4, reinject_input=True)
    with torch.no_grad():                       # halting p = sigmoid(sum of the state's features)
        model.universal.halting.unit.weight.fill_(1.0)
        model.universal.halting.unit.bias.zero_()
    x = torch.randn(4, N, DIM) + torch.tensor([3.0, -3.0, 3.0, -3.0])[:, None, None]   # rows 0, 2 halt first
    out = model(x)
    assert calls
    assert_close(out, torch.cat([model(x[r:r + 1]) for r in range(4)]))

def reference_attention(branch, h: torch.Tensor, v_first: torch.Tensor, mix: torch.Tensor | float) -> torch.Tensor:
    """Causal softmax attention of one block with values (1 - λ) V_1 + λ V_n, written out."""
    n = h.shape[1]
    q, kv = branch.project(h, Source(h, torch.arange(n)[None], None), torch.arange(n)[None])
    v = v_first + mix * (kv.v - v_first)
    scores = q @ kv.k.transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return branch.output(scores.softmax(-1) @ v, h)


@pytest.mark.parametrize("learned", [False, True])
def test_add_value_residual_formula(learned):
    model = make(custom_layers=("a", "a"), add_value_residual=True, learned_value_residual_mix=learned).double()
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    first: list[torch.Tensor] = []
    model.blocks[0].branch.project.register_forward_hook(lambda m, a, out: first.append(out[1].v))
    out = model(x)
    b0, b1 = model.blocks
    x1 = b0(x, ctx_of(N), None)[0]
    h = b1.norm_in(x1)
    mix = torch.sigmoid(b1.branch.value_residual.mix(h)).transpose(1, 2)[..., None] if learned else 0.5
    want = model.final_norm(b1.join(x1, reference_attention(b1.branch, h, first[0], mix)))
    assert_close(out, want)


def test_value_residual_limits_and_cross_attention():
    model = make(add_value_residual=True)
    with torch.no_grad():                                 # λ = 1: every block keeps its own values
        model.blocks[2].branch.value_residual.mix.weight.zero_()
        model.blocks[2].branch.value_residual.mix.bias.fill_(40.0)
    plain = make()
    plain.load_state_dict(model.state_dict(), strict=False)
    x = torch.randn(2, N, DIM)
    assert_close(model(x), plain(x))
    cross = make(CrossAttender, add_value_residual=True, learned_value_residual_mix=False)
    plain = make(CrossAttender)
    context = torch.randn(2, 5, DIM)
    with torch.no_grad():                                 # the second cross block's values = the first's: no mix
        w0, w1 = cross.blocks[0].branch.project.to_kv.weight, cross.blocks[2].branch.project.to_kv.weight
        w1[16:].copy_(w0[16:])
    plain.load_state_dict(cross.state_dict(), strict=False)
    assert_close(cross(x, context=context), plain(x, context=context))
    with torch.no_grad():
        w1[16:].add_(1.0)
    assert not torch.allclose(cross(x, context=context), plain(x, context=context))


def test_cross_attn_tokens_dropout_keeps_a_random_share_of_each_row():
    torch.manual_seed(0)
    context = torch.randn(3, 10, DIM)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, 6:] = False
    mask[2, 1:] = False
    kept, keep = drop_context(context, mask, 0.4)
    assert kept.shape == (3, 6, DIM)
    assert keep.sum(1).tolist() == [6, 4, 1]              # ceil(0.6 * valid), at least one
    for r in range(3):
        rows = [int((context[r] == t).all(-1).nonzero()) for t in kept[r][keep[r]]]
        assert rows == sorted(rows) and all(mask[r, i] for i in rows)
    model = make(cross_attend=True, cross_attn_tokens_dropout=0.4)
    x = torch.randn(3, N, DIM)
    torch.manual_seed(5)
    kept, keep = drop_context(context, mask, 0.4)
    want = model(x, context=kept, context_mask=keep)
    model.train()
    torch.manual_seed(5)
    assert_close(model(x, context=context, context_mask=mask), want)
    model.eval()
    assert not torch.allclose(model(x, context=context, context_mask=mask), want)


@pytest.mark.parametrize("name", POLICIES)
def test_policies_are_causal(name):
    model = make(**layer_keywords(name))
    x = torch.randn(2, 9, DIM)
    y = x.clone()
    y[:, 6:] += torch.randn(2, 3, DIM)
    assert_close(model(x)[:, :6], model(y)[:, :6])
    assert not torch.allclose(model(x)[:, 6:], model(y)[:, 6:])


@pytest.mark.parametrize("name", POLICIES)
def test_config_round_trips_through_json(name):
    cfg = make(**layer_keywords(name)).cfg
    assert from_dict(LayersConfig, to_dict(cfg)) == cfg


@pytest.mark.parametrize("keywords, named", [
    (dict(layers_execute_order=(0, 4)), "layers_execute_order"),
    (dict(layers_execute_order=(0, 1), weight_tie_layers=True), "layers_execute_order"),
    (dict(layers_execute_order=(0, 1), unet_skips=True), "unet_skips"),
    (dict(par_ratio=1), "par_ratio"),
    (dict(par_ratio=2, custom_layers=("a", "f")), "par_ratio"),
    (dict(layer_dropout=1.5), "layer_dropout"),
    (dict(layer_dropout=(0.1, 0.2)), "layer_dropout"),
    (dict(layer_dropout=0.1, reversible=True), "layer_dropout"),
    (dict(unet_skips=True, depth=1), "unet_skips"),
    (dict(unet_skips=True, weight_tie_layers=True), "unet_skips"),
    (dict(cross_attn_tokens_dropout=0.2), "cross_attn_tokens_dropout"),
    (dict(cross_attend=True, cross_attn_tokens_dropout=1.0), "cross_attn_tokens_dropout"),
    (dict(learned_reinject_input_gate=True), "reinject_input"),
    (dict(reinject_input=True, reversible=True), "reinject_input"),
    (dict(learned_value_residual_mix=False), "add_value_residual"),
    (dict(add_value_residual=True, weight_tie_layers=True), "add_value_residual"),
    (dict(add_value_residual=True, attn_fnet=True), "add_value_residual"),
    (dict(add_value_residual=True, layers_execute_order=(2, 3, 0, 1)), "add_value_residual"),
])
def test_bad_values_are_named(keywords, named):
    cls = Encoder if keywords.get("attn_fnet") else Decoder
    with pytest.raises((ValueError, TypeError), match=named):
        cls(dim=DIM, heads=2, **{"depth": 2, **keywords})
