"""Small builders shared by the tests: tiny models, CPU, float32."""

from __future__ import annotations

import gc
from typing import Any

import torch

from polyformer import AttentionLayers, Decoder, Encoder, TransformerWrapper

WRAPPER_KEYS = ("num_memory_tokens", "max_mem_len", "shift_mem_down", "emb_dropout", "tie_embedding",
                "use_abs_pos_emb", "scaled_sinu_pos_emb", "emb_dim", "logits_bias", "post_emb_norm",
                "embed_num_tokens", "axial_pos_emb", "axial_pos_emb_dims", "abs_pos_per_layer", "randomized_pos",
                "l2norm_embed", "emb_frac_gradient", "mixture_of_softmax", "mixture_of_softmax_k",
                "memory_tokens_interspersed_every")


def tiny_lm(stack: type[AttentionLayers] = Decoder, num_tokens: int = 64, max_seq_len: int = 32,
            dim: int = 32, depth: int = 2, heads: int = 4, seed: int | None = None,
            **keywords: Any) -> TransformerWrapper:
    """A TransformerWrapper over a tiny stack, in eval mode; wrapper keywords and layer keywords may
    be mixed. `seed`: the initial weights are drawn after torch.manual_seed(seed)."""
    if seed is not None:
        torch.manual_seed(seed)
    wrap = {k: keywords.pop(k) for k in list(keywords) if k in WRAPPER_KEYS}
    layers = stack(dim=dim, depth=depth, heads=heads, **keywords)
    return TransformerWrapper(num_tokens=num_tokens, max_seq_len=max_seq_len, attn_layers=layers, **wrap).eval()


def tiny_encoder(**keywords: Any) -> TransformerWrapper:
    return tiny_lm(Encoder, **keywords)


def ids(batch: int = 2, n: int = 12, num_tokens: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, num_tokens, (batch, n), generator=torch.Generator().manual_seed(seed))


def emptied_pool() -> int:
    """The buffer pool's free buffers dropped (after collecting unreachable graphs); how many buffers
    remain, held by tensors still alive."""
    from polyformer import buffers

    gc.collect()
    buffers.release()
    state = buffers.state()
    assert state["free"] == 0
    return state["buffers"]


def sgd_steps(model: torch.nn.Module, x: torch.Tensor, steps: int = 3) -> list[dict[str, int]]:
    """`steps` SGD steps (lr 0.1) of model on x's loss `loss_grads` differentiates; the buffer pool's
    state after each step's backward."""
    from polyformer import buffers

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    states = []
    for _ in range(steps):
        opt.zero_grad()
        model(x).logsumexp(-1).mean().backward()
        states.append(buffers.state())
        opt.step()
    opt.zero_grad(set_to_none=True)
    return states


def loss_grads(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The gradients of logsumexp(model(x)).mean() against every parameter."""
    return torch.autograd.grad(model(x).logsumexp(-1).mean(), list(model.parameters()))


def assert_same_where_kept(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor,
                           atol: float = 1e-5, grad_atol: float = 1e-4) -> None:
    """Two models with the same weights (e.g. the fused path and the reference) give the same logits at the
    kept positions of `mask`, and the same parameter gradients of their sum of squares."""
    from torch.testing import assert_close

    ya, yb = a(x, mask=mask), b(x, mask=mask)
    assert_close(ya[mask], yb[mask], atol=atol, rtol=atol)
    ga = torch.autograd.grad(ya[mask].square().sum(), list(a.parameters()))
    gb = torch.autograd.grad(yb[mask].square().sum(), list(b.parameters()))
    for u, v in zip(ga, gb):
        assert_close(u, v, atol=grad_atol, rtol=grad_atol)


def stepped(model: torch.nn.Module, x: torch.Tensor, prefill: int, last: int | None = None,
            **state_keywords: Any) -> torch.Tensor:
    """The model's output on x (b, n) through a fresh decode state (`new_state(b, n, **state_keywords)`):
    x[:, :prefill] in one call, one token per call up to `last` (default n), the rest in one call; joined."""
    b, n = x.shape
    last = n if last is None else last
    state = model.new_state(b, n, **state_keywords)
    chunks = [model(x[:, :prefill], state=state)] + [model(x[:, t:t + 1], state=state) for t in range(prefill, last)]
    if last < n:
        chunks.append(model(x[:, last:], state=state))
    return torch.cat(chunks, 1)
