"""The Compressive Transformer's memory (arXiv:1911.05507): the FIFO memories hold exactly the last
states and the compressions of the evicted ones, in order; each compression function is its formula;
the reconstruction loss is its formula and trains the compression alone; max_cmem_len=0 is
Transformer-XL; the compressed memory joins the keys before the XL memory; causality; XL wrapper
training and generation; bad input."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import Decoder, TransformerWrapper, XLAutoregressiveWrapper
from polyformer.build import build_model, model_config
from polyformer.losses import AuxLosses
from polyformer.memory.compressive import Compression
from polyformer.memory.memories import Memories
from tests.helpers import ids

DIM, HEADS = 16, 2


def model(seg=4, mem=6, cmem=3, ratio=2, fn="mean_pool", seed=0, **kw):
    torch.manual_seed(seed)
    wrapper_keys = ("shift_mem_down", "abs_pos_per_layer")
    wrap = {k: kw.pop(k) for k in list(kw) if k.startswith("cmem_") or k in wrapper_keys}
    stack = Decoder(dim=DIM, depth=2, heads=HEADS, attn_dim_head=8, rotary_pos_emb=True, **kw)
    return TransformerWrapper(num_tokens=32, max_seq_len=seg, max_mem_len=mem, max_cmem_len=cmem, cmem_ratio=ratio,
                              cmem_fn=fn, attn_layers=stack, **wrap).eval()


def block_inputs(net):
    """Records every self-attention block's input (b, n, dim) per call: {layer: [tensors]}."""
    seen = {}
    for layer, block in enumerate(b for b in net.attn_layers.blocks if b.kind == "a"):
        block.branch.register_forward_pre_hook(lambda m, args, layer=layer: seen.setdefault(layer, []).append(args[0]))
    return seen


def run(net, x, seg, mask=None):
    mems, outs = None, []
    for start in range(0, x.shape[1], seg):
        m = mask[:, start:start + seg] if mask is not None else None
        logits, mems = net(x[:, start:start + seg], mask=m, mems=mems, return_mems=True)
        outs.append(logits)
    return torch.cat(outs, 1), mems


def by_hand(fn, conv, old, c):
    """The compression of old (b, g c, dim) as its formula, slot by slot."""
    b, e, d = old.shape
    slots = []
    for t in range(e // c):
        group = old[:, t * c:(t + 1) * c]
        if fn == "max_pool":
            slots.append(group.max(1).values)
        elif fn == "mean_pool":
            slots.append(group.sum(1) / c)
        else:
            taps = [t * c + j for j in range(c)] if fn == "conv1d" else [t * c - (c - 1) + 2 * j for j in range(c)]
            out = conv.bias.expand(b, d).clone()
            for j, i in enumerate(taps):
                if i >= 0:
                    out = out + old[:, i] @ conv.weight[:, :, j].T
            slots.append(out)
    return torch.stack(slots, 1) if slots else old[:, :0]


@pytest.mark.parametrize("fn", ["max_pool", "mean_pool", "conv1d"])
@pytest.mark.parametrize("seg, mem, cmem, ratio", [(4, 6, 3, 2), (4, 4, 4, 3), (5, 3, 2, 4)])
def test_memories_hold_the_last_states_and_the_compressions_of_the_evicted(fn, seg, mem, cmem, ratio):
    net = model(seg, mem, cmem, ratio, fn)
    seen = block_inputs(net)
    x = ids(2, 6 * seg, 32)
    mems = None
    for k in range(6):
        _, mems = net(x[:, k * seg:(k + 1) * seg], mems=mems, return_mems=True)
        for layer in range(2):
            states = torch.cat(seen[layer], 1)                      # every input of the block so far, in order
            evicted = max(0, (states.shape[1] - mem) // ratio * ratio)   # whole groups of c leave
            assert torch.equal(mems.mems[layer], states[:, evicted:])
            conv = net.compressive.compress[layer].conv
            want = by_hand(fn, conv, states[:, :evicted], ratio)[:, -cmem:]
            assert_close(mems.cmems[layer], want, atol=1e-5, rtol=1e-5)
    assert mems.cmems[0].shape[1] == cmem and mems.mems[0].shape[1] < mem + ratio


@pytest.mark.parametrize("fn", ["max_pool", "mean_pool", "conv1d", "dilated_conv"])
@pytest.mark.parametrize("c", [1, 2, 3])
def test_compression_function_is_its_formula(fn, c):
    torch.manual_seed(0)
    f = Compression(fn, 8, c)
    old = torch.randn(2, 4 * c, 8)
    assert_close(f(old), by_hand(fn, f.conv, old, c), atol=1e-5, rtol=1e-5)


def test_most_used_keeps_the_most_attended_states_in_order():
    net = model(fn="most_used")
    attn = net.attn_layers.blocks[0].branch
    old, h = torch.randn(2, 6, DIM), torch.randn(2, 4, DIM)
    w_q, w_k, _ = attn.project.to_qkv.weight.split(HEADS * 8, 0)
    q = (h @ w_q.T).view(2, 4, HEADS, 8).transpose(1, 2)
    k = (old @ w_k.T).view(2, 6, HEADS, 8).transpose(1, 2)
    usage = (q @ k.transpose(-1, -2) / 8 ** 0.5).softmax(-1).sum((1, 2))         # attention received (b, e)
    keep = usage.topk(3, dim=1).indices.sort(1).values
    got = net.compressive.compressed(attn, 0, old, h, AuxLosses())
    assert torch.equal(got, old[torch.arange(2)[:, None], keep])
    f = Compression("most_used", 4, 2)
    usage = torch.tensor([[0.1, 5.0, 0.2, 3.0, 4.0, 0.0]])
    assert torch.equal(f(torch.arange(6.0).view(1, 6, 1).expand(1, 6, 4), usage)[0, :, 0], torch.tensor([1.0, 3, 4]))


def test_reconstruction_loss_is_the_attention_difference_and_trains_only_the_compression():
    net = model(fn="conv1d", cmem_loss_weight=0.5).train()
    seen = block_inputs(net)
    x = ids(2, 12, 32)
    _, mems = net(x[:, :4], return_mems=True)
    _, mems = net(x[:, 4:8], mems=mems, return_mems=True)                 # evicts states 0, 1
    old = [torch.cat(seen[layer], 1)[:, 2:6] for layer in range(2)]         # what the third segment evicts
    logits, record = net(x[:, 8:], mems=mems, return_intermediates=True)
    loss = record.losses.terms["cmem_reconstruction"]
    assert record.losses.weights["cmem_reconstruction"] == 0.5
    want = 0.0
    for layer in range(2):
        attn, h = net.attn_layers.blocks[2 * layer].branch, seen[layer][-1]
        w_q, w_k, w_v = attn.project.to_qkv.weight.split(HEADS * 8, 0)
        heads = lambda t: t.view(2, -1, HEADS, 8).transpose(1, 2)
        att = lambda m: ((heads(h @ w_q.T) @ heads(m @ w_k.T).transpose(-1, -2) / 8 ** 0.5).softmax(-1)
                         @ heads(m @ w_v.T))
        want = want + F.mse_loss(att(by_hand("conv1d", net.compressive.compress[layer].conv, old[layer], 2)),
                                 att(old[layer]))
    assert_close(loss, want, atol=1e-5, rtol=1e-5)
    params = dict(net.named_parameters())
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)))
    for name, g in grads.items():
        if name.startswith("compressive."):
            assert g is not None and g.abs().sum() > 0, name
        else:
            assert g is None or not g.any(), name             # the main network gets nothing from it
    # the language-model loss never reaches the compression (memories are detached) but trains K / V
    lm = F.cross_entropy(logits.transpose(1, 2), x[:, 8:])
    grads = dict(zip(params, torch.autograd.grad(lm, list(params.values()), allow_unused=True)))
    assert all(g is None or not g.any() for n, g in grads.items() if n.startswith("compressive."))
    assert grads["attn_layers.blocks.0.branch.project.to_qkv.weight"][HEADS * 8:].abs().sum() > 0


def test_max_cmem_len_zero_is_transformer_xl_bit_for_bit():
    torch.manual_seed(0)
    xl = TransformerWrapper(num_tokens=32, max_seq_len=4, max_mem_len=6,
                            attn_layers=Decoder(dim=DIM, depth=2, heads=HEADS, rel_pos_bias=True)).eval()
    torch.manual_seed(0)
    zero = TransformerWrapper(num_tokens=32, max_seq_len=4, max_mem_len=6, max_cmem_len=0,
                              attn_layers=Decoder(dim=DIM, depth=2, heads=HEADS, rel_pos_bias=True)).eval()
    x = ids(2, 16, 32)
    (a, ma), (b, mb) = run(xl, x, 4), run(zero, x, 4)
    assert torch.equal(a, b) and isinstance(mb, list) and all(torch.equal(u, v) for u, v in zip(ma, mb))
    assert zero.compressive is None and not [n for n, _ in zero.named_parameters() if "compress" in n]
    # a Memories record without compressed memories is the same as the list
    assert torch.equal(xl(x[:, :4], mems=Memories(ma)), xl(x[:, :4], mems=ma))


def test_compressed_memory_joins_the_keys_before_the_xl_memory():
    net = model(fn="mean_pool", rel_pos_bias=True)
    x = ids(2, 16, 32)
    _, mems = run(net, x[:, :12], 4)
    assert mems.cmems[0].shape[1] == 3
    joined = [torch.cat((c, m), 1) for c, m in zip(mems.cmems, mems.mems)]
    out = net(x[:, 12:], mems=mems)
    assert torch.equal(out, net(x[:, 12:], mems=joined))        # positions continue backwards over both
    assert not torch.allclose(out, net(x[:, 12:], mems=list(mems.mems)))


def test_masks_travel_inside_the_record():
    net = model(fn="max_pool", rel_pos_bias=True)
    x = ids(2, 16, 32)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[0, 1] = mask[1, 4:6] = False
    _, mems = run(net, x[:, :12], 4, mask[:, :12])
    assert torch.equal(mems.mem_masks[0], mask[:, 6:12])
    assert torch.equal(mems.cmem_masks[1], mask[:, :6].view(2, 3, 2).all(-1))   # a slot is kept when its group was
    joined = [torch.cat((c, m), 1) for c, m in zip(mems.cmems, mems.mems)]
    masks = [torch.cat((c, m), 1) for c, m in zip(mems.cmem_masks, mems.mem_masks)]
    assert torch.equal(net(x[:, 12:], mems=mems), net(x[:, 12:], mems=joined, mem_masks=masks))


def test_causal_inside_a_segment():
    net = model(fn="conv1d")
    x = ids(2, 16, 32)
    _, mems = run(net, x[:, :12], 4)
    y = x[:, 12:].clone()
    y[:, 2:] = (y[:, 2:] + 1) % 32
    assert_close(net(x[:, 12:], mems=mems)[:, :2], net(y, mems=mems)[:, :2])
    assert not torch.allclose(net(x[:, 12:], mems=mems)[:, 2:], net(y, mems=mems)[:, 2:])


def test_xl_wrapper_trains_and_generates_with_compressed_memories():
    net = model(seg=4, mem=4, cmem=4, ratio=2, fn="conv1d")
    xl = XLAutoregressiveWrapper(net)
    x = ids(2, 19, 32)
    logits, mems, aux = [], None, []
    for start in range(0, 18, 4):
        out, record = net(x[:, start:min(start + 4, 18)], mems=mems, return_intermediates=True)
        logits.append(out)
        mems = record.mems
        aux.append(record.losses.total() if record.losses else torch.tensor(0.0))
    want = F.cross_entropy(torch.cat(logits, 1).transpose(1, 2), x[:, 1:]) + sum(aux) / len(aux)
    loss = xl(x)
    assert_close(loss, want, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(loss, list(net.compressive.parameters()))
    assert all(g.abs().sum() > 0 for g in grads)
    prompts = ids(2, 6, 32, seed=1)
    out = xl.generate(prompts, 14, temperature=0.0)
    full = torch.cat((prompts, out), 1)
    steps, mems = [], None                                  # the segment-by-segment forward over the result
    for start in range(0, 19, 4):
        logits, mems = net(full[:, start:start + 4], mems=mems, return_mems=True)
        steps.append(logits)
    greedy = torch.cat(steps, 1).argmax(-1)
    assert torch.equal(greedy[:, 5:19], full[:, 6:20])
    assert mems.cmems[0].shape[1] == 4


def test_config_round_trip_and_bfloat16():
    net = model(fn="dilated_conv", ratio=3)
    again = build_model(model_config(net))
    again.load_state_dict(net.state_dict())
    x = ids(2, 12, 32)
    assert torch.equal(run(net, x, 4)[0], run(again, x, 4)[0])
    half = build_model(model_config(net)).to(torch.bfloat16)
    half.load_state_dict(net.state_dict())
    assert_close(run(half, x, 4)[0].float(), run(net, x, 4)[0], atol=0.1, rtol=0.1)


def test_per_layer_absolute_positions_cover_both_memories():
    """Their tables reach back over max_mem_len + c - 1 waiting states + max_cmem_len slots."""
    net = model(seg=4, mem=4, cmem=4, ratio=3, abs_pos_per_layer=True)
    _, mems = run(net, ids(2, 24, 32), 4)                     # 24 - 4 = 20 = 6 groups of 3 + 2 waiting
    assert mems.mems[0].shape[1] + mems.cmems[0].shape[1] == net.max_mem_len + 2 + 4


@pytest.mark.parametrize("keywords, match", [
    (dict(max_cmem_len=4, cmem_ratio=0), "cmem_ratio"),
    (dict(max_cmem_len=4, cmem_ratio=-2), "cmem_ratio"),
    (dict(max_cmem_len=4, cmem_ratio=1.5), "cmem_ratio"),
    (dict(max_cmem_len=-1), "max_cmem_len"),
    (dict(max_cmem_len=4, max_mem_len=0), "max_mem_len"),
    (dict(max_cmem_len=4, cmem_fn="max_pooling"), "cmem_fn.*'max_pool'"),
    (dict(cmem_fn="conv1d"), "cmem_fn.*max_cmem_len"),
    (dict(max_cmem_len=4, cmem_loss_weight=-1.0), "cmem_loss_weight"),
    (dict(max_cmem_len=4, shift_mem_down=1), "shift_mem_down"),
])
def test_bad_keywords_are_named(keywords, match):
    args = dict(num_tokens=32, max_seq_len=4, max_mem_len=4, attn_layers=Decoder(dim=DIM, depth=2, heads=HEADS))
    with pytest.raises(ValueError, match=match):
        TransformerWrapper(**{**args, **keywords})


def test_bad_memories_are_named():
    torch.manual_seed(0)
    xl = TransformerWrapper(num_tokens=32, max_seq_len=4, max_mem_len=4,
                            attn_layers=Decoder(dim=DIM, depth=2, heads=HEADS))
    mems = [torch.randn(2, 4, DIM)] * 2
    with pytest.raises(ValueError, match="max_cmem_len"):
        xl(ids(2, 4, 32), mems=Memories(mems, cmems=mems))
    with pytest.raises(ValueError, match="mem_masks"):
        xl(ids(2, 4, 32), mems=Memories(mems), mem_masks=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="cmems"):
        model()(ids(2, 4, 32), mems=Memories(mems, cmems=mems[:1]))
