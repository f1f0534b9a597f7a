"""The contenders of `benchmarks/sparse_patterns.py`: polyformer stacks with and without a sparse
attention pattern, and the attention layers users would pick instead at the same settings, each
wrapped as a `Contender` whose `call(x)` maps (batch, n, 512) float32 to the same shape.

- polyformer: `Decoder` / `Encoder(dim=512, heads=8, ...)`, one attention block
  (`custom_layers=("a",)`: pre-norm, q/k/v projection, attention, output projection, residual, and the
  stack's final norm) or a 4-layer model (default layout, with feedforwards).
- local-attention (PyPI `local-attention`): `LocalAttention(window_size=256, causal=True,
  look_backward=1, look_forward=0)` inside `LocalAttentionLayer`, which adds what polyformer's block
  has around its kernel (pre-norm, bias-free q/k/v and output projections, residual, final norm), so
  the two layers do the same work outside the attention core.
- Hugging Face transformers: `LongformerAttention` (`LongformerSelfAttention` + its output dense,
  dropout, residual and LayerNorm) and `BigBirdAttention` with `attention_type="block_sparse"`
  (`BigBirdBlockSparseAttention` + the same output sublayer), from tiny random configs, called with the
  attention masks their models would build for an unpadded batch (built once, outside the timed call,
  as the model does once per forward for all its layers).

Dropout is 0 everywhere, so train and eval mode compute the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

DIM, HEADS, DIM_HEAD = 512, 8, 64
WINDOW = 256                         # causal window (keys each query sees) of the dense-vs-window runs
LONGFORMER_WINDOW = 512              # Longformer's attention_window: 256 keys each side
BLOCK, RANDOM_BLOCKS = 64, 3         # BigBird's block_size and num_random_blocks
BIGBIRD_WINDOW = 3 * BLOCK           # polyformer attn_window matched to BigBird's 3 sliding blocks


@dataclass
class Contender:
    """One thing to measure: `call(x)` runs the forward of `module` on x (batch, n, DIM)."""

    name: str
    module: nn.Module
    call: Callable[[Tensor], Tensor]
    polyformer: bool                  # ours (the numerator of every ratio) or a competitor's
    note: str = ""

    def params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)


# --- polyformer -----------------------------------------------------------------------------------

def polyformer_stack(causal: bool, depth: int, layer_only: bool, seed: int = 0, **pattern: Any) -> nn.Module:
    from polyformer import Decoder, Encoder

    _seeded(seed)
    cls = Decoder if causal else Encoder
    extra: dict[str, Any] = {"custom_layers": ("a",)} if layer_only else {}
    return cls(dim=DIM, depth=depth, heads=HEADS, **extra, **pattern)


def polyformer(name: str, causal: bool, depth: int = 1, layer_only: bool = True,
               global_mask: Tensor | None = None, note: str = "", **pattern: Any) -> Contender:
    stack = polyformer_stack(causal, depth, layer_only, **pattern)
    if global_mask is None:
        return Contender(name, stack, stack, True, note)
    return Contender(name, stack, lambda x: stack(x, global_mask=global_mask), True, note)


class ProjectionsOnly(nn.Module):
    """The attention block without its attention core (the output projection reads v): the floor that
    no attention kernel can go below in one block's time."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.final_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.to_qkv = nn.Linear(DIM, 3 * HEADS * DIM_HEAD, bias=False)
        self.to_out = nn.Linear(HEADS * DIM_HEAD, DIM, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.to_qkv(self.norm(x)).chunk(3, dim=-1)
        return self.final_norm(x + self.to_out(v + 0 * (q + k)))     # q, k still take part in the backward


def dense_vs_window(layer_only: bool) -> list[Contender]:
    """polyformer causal dense against the causal window of WINDOW keys; one attention block or 4 layers.
    One block also times the block without its attention core, the floor of both."""
    depth = 1 if layer_only else 4
    shape = "1 attention block" if layer_only else "4 layers"
    out = [polyformer(f"polyformer dense ({shape})", True, depth, layer_only),
           polyformer(f"polyformer attn_window={WINDOW} ({shape})", True, depth, layer_only, attn_window=WINDOW)]
    if layer_only:
        _seeded(0)
        floor = ProjectionsOnly()
        out.append(Contender("floor: the block without attention core", floor, floor, False))
    return out


def kernel_path(c: Contender, forward: Callable[[], Any]) -> str:
    """Which polyformer attention code `forward()` (one forward of `c`) ran: the compiled CPU kernel (dense,
    or its causal band of w keys), ATen's SDPA and/or `block_sparse.part_attention` (once per pattern part);
    the module functions are wrapped for that forward only (they are looked up at call time)."""
    if not c.polyformer:
        return "-"
    import torch.nn.functional as F

    from polyformer.attention.kernels import block_sparse, cpu

    calls: dict[str, int] = {}

    def cpu_label(*args: Any, window: int = 0, **_: Any) -> str:
        return f"compiled CPU kernel, band of {window}" if window else "compiled CPU kernel, dense"

    hooks: list[tuple[Any, str, Callable[..., str]]] = [
        (cpu, "attention", cpu_label), (F, "scaled_dot_product_attention", lambda *a, **k: "ATen SDPA"),
        (block_sparse, "part_attention", lambda *a, **k: "block-sparse part_attention")]
    saved = [(mod, name, getattr(mod, name), label) for mod, name, label in hooks if hasattr(mod, name)]

    def counted(label: Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            key = label(*args, **kwargs)
            calls[key] = calls.get(key, 0) + 1
            return fn(*args, **kwargs)
        return wrapped

    for mod, name, fn, label in saved:
        setattr(mod, name, counted(label, fn))
    try:
        forward()
    finally:
        for mod, name, fn, _ in saved:
            setattr(mod, name, fn)
    return ", ".join(f"{k} x{v}" for k, v in calls.items()) or "other"


# --- local-attention ------------------------------------------------------------------------------

class LocalAttentionLayer(nn.Module):
    """local-attention's core in the layer polyformer's attention block is: LayerNorm, bias-free q/k/v
    projection to 8 heads of 64, the core, bias-free output projection, residual, final LayerNorm."""

    def __init__(self, rotary: bool) -> None:
        super().__init__()
        from local_attention import LocalAttention

        self.norm = nn.LayerNorm(DIM)
        self.to_qkv = nn.Linear(DIM, 3 * HEADS * DIM_HEAD, bias=False)
        # dim=DIM_HEAD switches on its rotary embedding unless use_rotary_pos_emb=False
        self.core = LocalAttention(window_size=WINDOW, causal=True, look_backward=1, look_forward=0,
                                   dim=DIM_HEAD, use_rotary_pos_emb=rotary)
        self.to_out = nn.Linear(HEADS * DIM_HEAD, DIM, bias=False)
        self.final_norm = nn.LayerNorm(DIM)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = self.to_qkv(self.norm(x)).view(b, n, 3, HEADS, DIM_HEAD).permute(2, 0, 3, 1, 4)
        out = self.core(q, k, v)                                     # (b, heads, n, 64)
        out = out.transpose(1, 2).reshape(b, n, HEADS * DIM_HEAD)
        return self.final_norm(x + self.to_out(out))


LOCAL_NOTE = (f"local-attention's window_size={WINDOW}, look_backward=1 splits the sequence into blocks of {WINDOW}; "
              f"a query sees its own block up to itself and the whole previous block: {WINDOW + 1} to {2 * WINDOW} "
              f"keys (mean {WINDOW * 3 // 2}), against polyformer's exactly {WINDOW} (the last {WINDOW} keys, itself "
              "included). Its scores are computed for all 2 x 256 keys of each block pair either way.")


def local_attention(rotary_variant: bool = True) -> list[Contender]:
    """polyformer's causal window layer against local-attention's, without and (optionally) with its
    rotary embedding (what passing `dim=64` alone gives)."""
    out = [polyformer(f"polyformer attn_window={WINDOW}", True, attn_window=WINDOW)]
    for rotary in (False, True) if rotary_variant else (False,):
        _seeded(0)
        layer = LocalAttentionLayer(rotary)
        name = "local-attention" + (" + its rotary (dim=64)" if rotary else "")
        out.append(Contender(name, layer, layer, False, LOCAL_NOTE))
    return out


# --- Hugging Face ---------------------------------------------------------------------------------

def longformer(n: int, batch: int = 1) -> Contender:
    from transformers import LongformerConfig
    from transformers.models.longformer.modeling_longformer import LongformerAttention

    _seeded(0)
    config = LongformerConfig(hidden_size=DIM, num_attention_heads=HEADS, num_hidden_layers=1,
                              intermediate_size=4 * DIM, attention_window=[LONGFORMER_WINDOW],
                              attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0,
                              max_position_embeddings=n + 2)
    layer = LongformerAttention(config, layer_id=0)
    # LongformerModel's per-layer mask for an unpadded batch without global tokens: 0 = local attention
    mask = torch.zeros(batch, n)
    none = torch.zeros(batch, n, dtype=torch.bool)

    def call(x: Tensor) -> Tensor:
        return layer(x, attention_mask=mask, is_index_masked=none, is_index_global_attn=none,
                     is_global_attn=False)[0]
    return Contender("HF LongformerAttention", layer, call, False,
                     f"attention_window={LONGFORMER_WINDOW}: |i - j| <= {LONGFORMER_WINDOW // 2}, no global tokens")


def bigbird(n: int, batch: int = 1) -> Contender:
    from transformers import BigBirdConfig
    from transformers.models.big_bird.modeling_big_bird import BigBirdAttention, BigBirdModel

    _seeded(0)
    config = BigBirdConfig(hidden_size=DIM, num_attention_heads=HEADS, num_hidden_layers=1,
                           intermediate_size=4 * DIM, attention_type="block_sparse", block_size=BLOCK,
                           num_random_blocks=RANDOM_BLOCKS, max_position_embeddings=n,
                           attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    layer = BigBirdAttention(config, seed=0)
    blocked, band, from_mask, to_mask = BigBirdModel.create_masks_for_block_sparse_attn(torch.ones(batch, n), BLOCK)

    def call(x: Tensor) -> Tensor:
        return layer(x, band_mask=band, from_mask=from_mask, to_mask=to_mask,
                     from_blocked_mask=blocked, to_blocked_mask=blocked)[0]
    return Contender("HF BigBirdAttention (block_sparse)", layer, call, False,
                     f"block_size={BLOCK}, num_random_blocks={RANDOM_BLOCKS}; first and last block global")


def bigbird_global_mask(n: int, batch: int = 1) -> Tensor:
    """BigBird's global tokens are its first and last block; polyformer's attn_global_tokens=64 marks the
    first 64 and the forward's global_mask adds the last 64."""
    mask = torch.zeros(batch, n, dtype=torch.bool)
    mask[:, :BLOCK] = True
    mask[:, -BLOCK:] = True
    return mask


BIGBIRD_NOTE = (f"BigBird (ITC): a middle query block sees its block and the two beside it (3 x {BLOCK} = "
                f"{3 * BLOCK} keys, block-aligned), {RANDOM_BLOCKS} random blocks and the first and last block "
                f"(global both ways). polyformer: attn_window={BIGBIRD_WINDOW} (|i - j| <= {BIGBIRD_WINDOW // 2}: "
                f"{BIGBIRD_WINDOW + 1} keys, the same count, token-centred rather than block-aligned), "
                f"attn_random_blocks={RANDOM_BLOCKS} of attn_block_size={BLOCK} (never the blocks the window or the "
                f"globals already show), attn_global_tokens={BLOCK} plus global_mask on the last {BLOCK} tokens. "
                "In eval mode HF 5.x draws no random blocks (all point at block 0) but still computes them.")


def hf(n: int, which: str) -> list[Contender]:
    if which == "longformer":
        return [polyformer(f"polyformer Encoder attn_window={LONGFORMER_WINDOW}", False,
                           attn_window=LONGFORMER_WINDOW), longformer(n)]
    return [polyformer("polyformer Encoder BigBird pattern", False, global_mask=bigbird_global_mask(n),
                       note=BIGBIRD_NOTE, attn_window=BIGBIRD_WINDOW, attn_global_tokens=BLOCK,
                       attn_random_blocks=RANDOM_BLOCKS, attn_block_size=BLOCK), bigbird(n)]
