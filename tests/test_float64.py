"""A float64 model computes in float64: norms, softmax, rotary and positions never drop to float32
(issue 25), so its gradients agree with finite differences."""

from __future__ import annotations

import pytest
import torch

from polyformer import Decoder, Encoder, TransformerWrapper

CONFIGS = {
    "default": dict(),
    "rotary, rms norm": dict(rotary_pos_emb=True, use_rmsnorm=True),
    "alibi, scale norm, top-k": dict(alibi_pos_emb=True, use_scalenorm=True, attn_sparse_topk=3),
    "t5 bias, talking heads": dict(rel_pos_bias=True, attn_talking_heads=True),
    "infused, entmax": dict(position_infused_attn=True, attn_use_entmax15=True),
}


def model(stack: type, layers: dict, **wrapper) -> TransformerWrapper:
    torch.manual_seed(0)
    net = TransformerWrapper(num_tokens=20, max_seq_len=8, **wrapper,
                             attn_layers=stack(dim=16, depth=2, heads=2, attn_dim_head=8, **layers))
    return net.double()


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("stack", [Decoder, Encoder])
def test_every_intermediate_stays_float64(name, stack):
    net = model(stack, CONFIGS[name], scaled_sinu_pos_emb=not CONFIGS[name])
    seen: list[tuple[str, torch.dtype]] = []

    def record(module, args, out):
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                seen.append((type(module).__name__, t.dtype))

    hooks = [m.register_forward_hook(record) for m in net.modules()]
    try:
        logits, attn = net(torch.randint(0, 20, (2, 8)), return_attn=True)
    finally:
        for h in hooks:
            h.remove()
    assert logits.dtype == torch.float64 and all(a.dtype == torch.float64 for a in attn)
    lower = sorted({name for name, dtype in seen if dtype != torch.float64})
    assert not lower and len(seen) > 10, f"modules that left float64: {lower}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_match_finite_differences(name):
    """torch.autograd.gradcheck of the whole stack in float64, to 1e-8."""
    net = model(Decoder, CONFIGS[name])
    stack = net.attn_layers
    x = torch.randn(1, 5, 16, dtype=torch.float64, requires_grad=True, generator=torch.Generator().manual_seed(1))
    assert torch.autograd.gradcheck(lambda t: stack(t), (x,), eps=1e-6, atol=1e-8, rtol=1e-6)
