"""Checks shared by the tests of x-transformers 2.31.10's README blocks (test_xt2_readme*.py)."""

from __future__ import annotations

import torch
from torch import nn

from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper

NUM = 256       # README: num_tokens 20000 (256 where it says so)
DIM = 32        # README: 512
DEPTH = 2       # README: 6 or 12
SEQ = 16        # README: 1024 (512 for Transformer-XL)


def ids(n: int = SEQ, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, NUM, (batch, n), generator=torch.Generator().manual_seed(seed))


def assert_finite(t: torch.Tensor) -> None:
    assert torch.isfinite(t).all(), "NaN or inf in the output"


def assert_trains(loss: torch.Tensor, *models: nn.Module, skip: tuple[str, ...] = ()) -> None:
    """A finite scalar loss whose backward reaches every parameter of `models` with a finite gradient
    (parameter names containing one of `skip` are exempt)."""
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    for model in models:
        for name, p in model.named_parameters():
            if any(s in name for s in skip):
                continue
            assert p.grad is not None, f"no gradient reached {name}"
            assert torch.isfinite(p.grad).all(), f"non-finite gradient at {name}"


@torch.no_grad()
def assert_causal(model: nn.Module, x: torch.Tensor, split: int | None = None, **kwargs) -> None:
    """Changing inputs at positions >= split leaves the outputs before split exactly as they were and
    changes the outputs from split on."""
    was = model.training
    model.eval()
    split = x.shape[1] // 2 if split is None else split
    y = x.clone()
    if x.dtype.is_floating_point:
        y[:, split:] = torch.randn_like(y[:, split:])
    else:
        y[:, split:] = (y[:, split:] + 1) % NUM
    a, b = model(x, **kwargs), model(y, **kwargs)
    model.train(was)
    torch.testing.assert_close(a[:, :split], b[:, :split], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, split:], b[:, split:]), "later positions ignored their own inputs"


@torch.no_grad()
def assert_bidirectional(model: nn.Module, x: torch.Tensor, **kwargs) -> None:
    """An encoder: the last token's change reaches the first position's output."""
    was = model.training
    model.eval()
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % NUM
    assert not torch.allclose(model(x, **kwargs)[:, 0], model(y, **kwargs)[:, 0])
    model.train(was)


def assert_cached_generation(model: TransformerWrapper, prompt_len: int = 6, steps: int = 6) -> torch.Tensor:
    """Greedy generation with the decode state equals generation that reruns the whole sequence; both
    give `steps` tokens per row."""
    wrapper = AutoregressiveWrapper(model)
    prompt = ids(prompt_len, batch=2, seed=1)
    cached = wrapper.generate(prompt, steps, temperature=0.0, cache_kv=True)
    uncached = wrapper.generate(prompt, steps, temperature=0.0, cache_kv=False)
    assert cached.shape == (2, steps)
    assert torch.equal(cached, uncached)
    return cached


def copy_weights(src: nn.Module, dst: nn.Module, strict: bool = True) -> nn.Module:
    """dst with src's weights (strict=False: parameters only one of them has are left out); dst in eval mode."""
    dst.load_state_dict(src.state_dict(), strict=strict)
    return dst.eval()


def lm(**layer_keywords) -> TransformerWrapper:
    """TransformerWrapper(num_tokens, max_seq_len, attn_layers=Decoder(dim, depth, heads, **layer_keywords))."""
    return TransformerWrapper(num_tokens=NUM, max_seq_len=SEQ,
                              attn_layers=Decoder(dim=DIM, **{"depth": DEPTH, "heads": 8, **layer_keywords}))


def enc(**layer_keywords) -> TransformerWrapper:
    """As `lm`, with an Encoder."""
    return TransformerWrapper(num_tokens=NUM, max_seq_len=SEQ,
                              attn_layers=Encoder(dim=DIM, **{"depth": DEPTH, "heads": 8, **layer_keywords}))
