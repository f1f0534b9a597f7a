"""Checks shared by the README tests: the 2021 README's blocks (test_spec_examples*.py) and x-transformers
2.31.10's README (its package description; test_xt2_readme*.py).

The xt2 files run its python blocks in README order, with `x_transformers` -> `polyformer`. Each block keeps
its keywords and call pattern; sizes are ours (dim 32, depth 2, seq 16, 256 tokens); `.cuda()` is dropped; a
block that misses its own import gets it. A block that only builds `TransformerWrapper(num_tokens,
max_seq_len, <wrapper keywords>, attn_layers = Decoder(dim, depth, heads, ...))` (or an Encoder, or the
README's XTransformer) is built by `lm(...)` (`enc(...)`, `xt(...)`) with its keywords as written. A block
the 2021 README already has verbatim is tested once, in test_spec_examples*.py (`..._both_readmes`). Each
test asserts what the block claims."""

from __future__ import annotations

import torch
from torch import nn

from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper, XTransformer
from tests import helpers

NUM = 256       # README: num_tokens 20000 (256 where it says so)
DIM = 32        # README: 512
DEPTH = 2       # README: 6 or 12
SEQ = 16        # README: 1024 (512 for Transformer-XL)


def ids(n: int = SEQ, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return helpers.ids(batch, n, NUM, seed)


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


@torch.no_grad()
def assert_relative(model: TransformerWrapper, offset: int = 5) -> None:
    """Relative positions only: moving the whole sequence by `offset` positions changes nothing (model left in eval)."""
    x = ids()
    pos = torch.arange(SEQ)[None]
    torch.testing.assert_close(model.eval()(x, pos = pos + offset), model(x, pos = pos), atol=1e-4, rtol=1e-4)


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


def glu_reference(ff: nn.Module, h: torch.Tensor, act) -> torch.Tensor:
    """A GLU feedforward's output computed by hand: proj_out(value * act(gate))."""
    value, gate = ff.proj_in(h).chunk(2, dim=-1)
    return ff.proj_out(value * act(gate))


def copy_weights(src: nn.Module, dst: nn.Module, strict: bool = True) -> nn.Module:
    """dst with src's weights (strict=False: parameters only one of them has are left out); dst in eval mode."""
    dst.load_state_dict(src.state_dict(), strict=strict)
    return dst.eval()


def lm(**keywords) -> TransformerWrapper:
    """TransformerWrapper(num_tokens, max_seq_len, attn_layers=Decoder(dim, depth, heads, ...)) in training mode;
    wrapper and layer keywords may be mixed (helpers.tiny_lm sorts them)."""
    return helpers.tiny_lm(Decoder, NUM, SEQ, DIM, **{"depth": DEPTH, "heads": 8, **keywords}).train()


def enc(**keywords) -> TransformerWrapper:
    """As `lm`, with an Encoder."""
    return helpers.tiny_lm(Encoder, NUM, SEQ, DIM, **{"depth": DEPTH, "heads": 8, **keywords}).train()


def xt(**keywords) -> XTransformer:
    """The README's XTransformer(dim, enc_num_tokens, enc_depth, enc_heads, enc_max_seq_len, dec_...) plus keywords."""
    return XTransformer(dim=DIM, enc_num_tokens=NUM, enc_depth=DEPTH, enc_heads=8, enc_max_seq_len=SEQ,
                        dec_num_tokens=NUM, dec_depth=DEPTH, dec_heads=8, dec_max_seq_len=SEQ, **keywords)
