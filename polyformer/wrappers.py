"""Wrappers around a layer stack: tokens (`TransformerWrapper`), vectors
(`ContinuousTransformerWrapper`) and images (`ViTransformerWrapper`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import checks, landmark
from .embedding import AxialPositions, ExtraEmbeddings, LearnedPositions, MemoryTokens, PatchEmbedding, TokenEmbedding
from .keywords import checked_keywords
from .memory import infini_carry, memories
from .memory.kv_cache import DecodeState
from .position import wrapper_positions
from .registry import NORM
from .stack import AttentionLayers, Intermediates


def _stack(attn_layers: object, owner: str) -> AttentionLayers:
    if not isinstance(attn_layers, AttentionLayers):
        raise TypeError(f"{owner}: attn_layers must be an Encoder, Decoder or AttentionLayers, "
                        f"got {type(attn_layers).__name__}")
    return attn_layers


class SequenceWrapper(nn.Module):
    """embed -> absolute positions -> post-embedding norm -> dropout -> memory tokens -> stack -> head,
    with XL memories.

    Subclasses supply `embed(x)` (b, n, dim) and `head(x)`.
    """

    def _setup(self, *, attn_layers: AttentionLayers, max_seq_len: int, emb_dropout: float,
               num_memory_tokens: int | None, use_abs_pos_emb: bool | None, scaled_sinu_pos_emb: bool,
               max_mem_len: int, shift_mem_down: int, post_emb_norm: bool = False,
               post_emb_proj: bool = False, axial_pos_emb: object = None, axial_pos_emb_dims: object = None,
               abs_pos_per_layer: object = False, randomized_pos: object = None, cmem: tuple = (0,)) -> None:
        owner = type(self).__name__
        self.attn_layers = _stack(attn_layers, owner)
        dim = self.attn_layers.dim
        if not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"{owner}: max_seq_len must be a positive integer, got {max_seq_len!r}")
        if not 0 <= emb_dropout < 1:
            raise ValueError(f"{owner}: emb_dropout must be in [0, 1), got {emb_dropout}")
        self.max_mem_len = max_mem_len
        self.shift_mem_down = shift_mem_down        # checked with the compressed memory's keywords (memory/memories.py)
        self.compressive = memories.setup(owner, self.attn_layers, max_mem_len, shift_mem_down, num_memory_tokens,
                                          cmem)
        self.randomized_pos = randomized_pos        # max_seq_len becomes its L (position/randomized.py)
        self.pos_emb, self.max_seq_len = wrapper_positions.setup(
            self.attn_layers, owner, max_seq_len, use_abs_pos_emb, scaled_sinu_pos_emb, axial_pos_emb,
            axial_pos_emb_dims, abs_pos_per_layer, randomized_pos, memories.span(self), num_memory_tokens or 0)
        self.post_emb_norm = None
        if post_emb_norm:                 # the stack's own norm and eps (BERT: LayerNorm, eps 1e-12)
            cfg = self.attn_layers.cfg
            if NORM[cfg.norm].build is None:
                raise ValueError(f"{owner}: post_emb_norm=True uses the stack's norm, and use_rezero=True "
                                 "leaves the stack without one")
            self.post_emb_norm = NORM[cfg.norm].build(dim, cfg.norm_eps)
        if not isinstance(post_emb_proj, bool):
            raise TypeError(f"{owner}: post_emb_proj must be True or False, got {post_emb_proj!r}")
        self.post_emb_proj = nn.Linear(dim, dim) if post_emb_proj else None
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.memory_tokens = MemoryTokens(num_memory_tokens, dim) if num_memory_tokens else None
        self.landmarks = landmark.attach(self.attn_layers, owner, num_memory_tokens, max_mem_len)

    @property
    def bounded(self) -> bool:
        """Whether sequences are limited to max_seq_len (learned, axial or per-layer absolute positions)."""
        return isinstance(self.pos_emb, (LearnedPositions, AxialPositions)) or self.attn_layers.layer_pos is not None

    def _check_common(self, n: int, b: int, mask: Tensor | None, mems: list[Tensor] | None,
                      return_mems: bool, return_attn: bool, pos: Tensor | None,
                      state: DecodeState | None) -> None:
        if mask is not None:
            checks.bool_mask("mask", mask, (b, n), "(batch, seq)")
        if pos is not None:
            pos = checks.tensor("pos", pos)
            if pos.ndim != 2 or pos.shape[1] != n or pos.shape[0] not in (1, b) or pos.dtype.is_floating_point:
                raise ValueError(f"pos must be integer positions of shape (batch or 1, {n}), got "
                                 f"{tuple(pos.shape)} {pos.dtype}")
        if mems is not None and not isinstance(mems, (list, tuple, memories.Memories)):
            raise ValueError("mems must be a list of tensors (one per self-attention block), got "
                             f"{type(mems).__name__}")
        if (mems is not None or return_mems) and not infini_carry.carries(self):
            raise ValueError(f"{type(self).__name__}: mems / return_mems need a model built with max_mem_len > 0 "
                             "(or attn_infini blocks, not in a universal / hourglass stack)")
        if return_mems and return_attn:
            raise ValueError("return_mems and return_attn cannot both be set: use return_intermediates=True")
        if state is not None and (mems is not None or return_mems):
            raise ValueError("state cannot be combined with mems / return_mems")

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, history: int = 1) -> DecodeState:
        """A decode state (KV cache) with room for max_len tokens of `batch` sequences; blocks with a
        recurrent summary keep it after each of the last `history` positions (for rollback)."""
        max_len = landmark.room(self.landmarks, batch, max_len)      # with room for the landmarks (landmark.py)
        return self.attn_layers.new_state(batch, max_len + self.num_memory_tokens, dtype, device, history)

    @property
    def num_memory_tokens(self) -> int:
        return self.memory_tokens.tokens.shape[0] if self.memory_tokens is not None else 0

    def add_positions(self, h: Tensor, tok_pos: Tensor) -> Tensor:
        """Embeddings h (b, n, dim) at token positions tok_pos (b|1, n): plus the absolute
        positions, then the post-embedding norm, projection and dropout."""
        if self.pos_emb is not None:
            h = h + self.pos_emb(tok_pos).to(h.dtype)
        if self.post_emb_norm is not None:
            h = self.post_emb_norm(h)
        if self.post_emb_proj is not None:
            h = self.post_emb_proj(h)
        return self.emb_dropout(h)

    def _run(self, h: Tensor, mask: Tensor | None, context: Tensor | None, context_mask: Tensor | None,
             mems: list[Tensor] | None, mem_masks: list[Tensor] | Tensor | None, need_record: bool,
             return_attn: bool, pos: Tensor | None = None, state: DecodeState | None = None,
             prefix_len: Tensor | int | None = None, global_mask: Tensor | None = None,
             knn_clear: Tensor | None = None
             ) -> tuple[Tensor, Intermediates | None, list[Tensor] | memories.Memories | None]:
        seen, seen_masks = memories.attended(self, mems, mem_masks)     # [compressed, XL] memory, shift_mem_down
        carried = infini_carry.begin(self, mems, need_record and state is None, h.shape[0])   # Infini memories
        h, mask, pos, slots = landmark.insert(self.landmarks, h, mask, pos, state, self.attn_layers)
        tok_pos = wrapper_positions.token_positions(self, h, pos, state)
        h = self.add_positions(h, tok_pos)
        stack_pos = tok_pos + self.num_memory_tokens + (seen[0].shape[1] if seen else 0)
        prefix = self.memory_tokens is not None and (state is None or state.length == 0)
        if prefix:
            if global_mask is not None:
                checks.bool_mask("global_mask", global_mask, tuple(h.shape[:2]), "(batch, seq)")
                global_mask = F.pad(global_mask, (self.num_memory_tokens, 0), value=False)
            h, mask = self.memory_tokens(h, mask)
            first = torch.arange(self.num_memory_tokens, device=h.device)[None]
            stack_pos = torch.cat((first.expand(stack_pos.shape[0], -1), stack_pos), dim=1)
        out = self.attn_layers(h, mask=mask, context=context, context_mask=context_mask, mems=seen,
                               mem_masks=seen_masks, pos=stack_pos, state=state,
                               prefix=self.num_memory_tokens if prefix else 0, prefix_len=prefix_len,
                               global_mask=global_mask, return_attn=return_attn,
                               return_intermediates=need_record, knn_clear=knn_clear, carried=carried)
        record = None
        if need_record:
            out, record = out
        if prefix:
            out = out[:, self.num_memory_tokens:]
        new_mems = None
        if (self.max_mem_len or carried is not None) and record is not None:
            new_mems = memories.update(self, mems, mem_masks, seen, record, mask, carried)
        return landmark.remove(out, slots), record, new_mems

    def _finish(self, out: Tensor, record: Intermediates | None, new_mems: list[Tensor] | None,
                return_embeddings: bool, return_mems: bool, return_attn: bool,
                return_intermediates: bool) -> Any:
        result = out if return_embeddings else self.head(out)
        if return_intermediates:
            record.mems = new_mems if new_mems is not None else record.mems
            return result, record
        if return_mems:
            return result, new_mems
        if return_attn:
            return result, record.attn
        return result


class TransformerWrapper(SequenceWrapper):
    """Token ids in, logits (or embeddings) out.

    Args:
        num_tokens: vocabulary size; ids must lie in [0, num_tokens).
        max_seq_len: longest sequence for learned absolute positions.
        attn_layers: an `Encoder`, `Decoder` or `AttentionLayers`.
        emb_dim: token embedding size when it differs from the stack's dim (projected in and out).
        emb_dropout: dropout after the embedding.
        num_memory_tokens: learned tokens prepended to every sequence (arXiv:2006.11527).
        tie_embedding: output logits use the token embedding matrix.
        use_abs_pos_emb: absolute positions on or off; None (default) turns them off when the stack
            carries positions itself (rotary, ALiBi, T5, position-infused).
        scaled_sinu_pos_emb: the absolute positions are sinusoids with one learned scale instead of
            learned vectors (as in x-transformers, it picks the kind; use_abs_pos_emb=False refuses it).
        max_mem_len: Transformer-XL memory length kept by `return_mems`.
        max_cmem_len, cmem_ratio (c, 4), cmem_fn ("conv1d"), cmem_loss_weight (1): a compressed memory
            (arXiv:1911.05507, memory/compressive.py) of the states leaving the XL memory; return_mems then
            gives a `Memories` record.
        shift_mem_down: route layer l's memory to layer l - shift_mem_down (ERNIE-Doc, arXiv:2012.15688).
        logits_dim: size of the output logits when it differs from num_tokens.
        logits_bias: the untied output head has a bias (False: none, as Llama's lm_head).
        post_emb_norm: normalise the summed embeddings (token, extra, absolute position) with the
            stack's norm and norm_eps before the stack (BERT's embedding LayerNorm).
        post_emb_proj: a linear layer (dim -> dim, with bias) after the post-embedding norm, before
            dropout and the stack (FNet's embedding projection).
        embed_num_tokens: extra embedding tables added to the token embedding, {name: vocabulary
            size}, e.g. {"token_type": 2} for BERT's segments; forward takes their ids as
            `embed_ids={name: (b, n) ids}`, and a table whose ids are not given adds its id 0 at
            every position (BERT's default segment).
        axial_pos_emb: (a, b), a * b >= max_seq_len: axial absolute positions (Reformer, position/axial.py),
            p -> concat(E1[p // b], E2[p % b]); axial_pos_emb_dims: their sizes (d1, d2), d1 + d2 = dim
            (default dim // 2 and the rest).
        abs_pos_per_layer: every self-attention layer adds its own learned absolute positions to its input, the
            first layer's in place of the input's (Al-Rfou et al., arXiv:1808.04444; position/per_layer_abs.py).
        randomized_pos: L > max_seq_len: training positions are a sorted random sample of [0, L) per row, evaluation
            0 .. n-1; learned tables get L rows and max_seq_len becomes L (arXiv:2305.16843; position/randomized.py).

    forward(x (b, n) int, mask (b, n) bool, context, context_mask, mems, mem_masks,
    return_embeddings, return_mems, return_attn, return_intermediates, pos, state, prefix_len,
    embed_ids, knn_clear) -> logits
    (b, n, num_tokens), embeddings (b, n, dim), or a pair with the memories / attention maps /
    Intermediates. `pos` (b|1, n) overrides the token positions (per-row positions of a left-padded
    batch); `state` (from `new_state`) makes x a continuation of the cached positions; `prefix_len`
    (int or (b,), causal stacks) makes the first prefix_len tokens a bidirectional prefix (prefix-LM);
    `knn_clear` (b,) bool clears those rows' kNN memories first (knn_memory_layers: a new document).
    """

    @checked_keywords
    def __init__(self, *, num_tokens: int, max_seq_len: int, attn_layers: AttentionLayers,
                 emb_dim: int | None = None, emb_dropout: float = 0.0,
                 num_memory_tokens: int | None = None, tie_embedding: bool = False,
                 use_abs_pos_emb: bool | None = None, scaled_sinu_pos_emb: bool = False,
                 max_mem_len: int = 0, shift_mem_down: int = 0, logits_dim: int | None = None,
                 logits_bias: bool = True, post_emb_norm: bool = False,
                 embed_num_tokens: dict[str, int] | None = None, post_emb_proj: bool = False,
                 axial_pos_emb: tuple[int, int] | None = None, axial_pos_emb_dims: tuple[int, int] | None = None,
                 abs_pos_per_layer: bool = False, randomized_pos: int | None = None, max_cmem_len: int = 0,
                 cmem_ratio: int | None = None, cmem_fn: str | None = None, cmem_loss_weight: float | None = None):
        super().__init__()
        stack = _stack(attn_layers, "TransformerWrapper")
        dim = stack.dim
        emb_dim = emb_dim or dim
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"TransformerWrapper: num_tokens must be a positive integer, got {num_tokens!r}")
        if tie_embedding and (emb_dim != dim or logits_dim not in (None, num_tokens)):
            raise ValueError("TransformerWrapper: tie_embedding=True needs emb_dim == dim and logits_dim == num_tokens")
        if tie_embedding and stack.out_dim != dim:
            raise ValueError(f"TransformerWrapper: tie_embedding=True needs the stack's output to have dim features; "
                             f"reversible_merge='concat' gives {stack.out_dim}")
        self.num_tokens = num_tokens
        self.token_emb = TokenEmbedding(num_tokens, emb_dim)
        self.project_emb = nn.Linear(emb_dim, dim) if emb_dim != dim else None
        self.embeds = ExtraEmbeddings(embed_num_tokens, dim) if embed_num_tokens else None
        self._setup(attn_layers=stack, max_seq_len=max_seq_len, emb_dropout=emb_dropout,
                    num_memory_tokens=num_memory_tokens, use_abs_pos_emb=use_abs_pos_emb,
                    scaled_sinu_pos_emb=scaled_sinu_pos_emb, max_mem_len=max_mem_len,
                    shift_mem_down=shift_mem_down, post_emb_norm=post_emb_norm, post_emb_proj=post_emb_proj,
                    axial_pos_emb=axial_pos_emb, axial_pos_emb_dims=axial_pos_emb_dims,
                    abs_pos_per_layer=abs_pos_per_layer, randomized_pos=randomized_pos,
                    cmem=(max_cmem_len, cmem_ratio, cmem_fn, cmem_loss_weight))
        self.tie_embedding = tie_embedding
        self.to_logits = (None if tie_embedding
                          else nn.Linear(stack.out_dim, logits_dim or num_tokens, bias=logits_bias))

    def head(self, x: Tensor) -> Tensor:
        if self.to_logits is None:
            return x @ self.token_emb.weight.t()
        return self.to_logits(x)

    def embed(self, x: Tensor, embed_ids: dict[str, Tensor] | None = None) -> Tensor:
        """Token ids (b, n) -> (b, n, dim): the token embedding, projected from emb_dim, plus the
        extra embeddings (their id 0 where `embed_ids` does not give one)."""
        h = self.token_emb(x)
        if self.project_emb is not None:
            h = self.project_emb(h)
        if self.embeds is not None:
            h = self.embeds(h, embed_ids or {})
        return h

    def forward(self, x: Tensor, mask: Tensor | None = None, context: Tensor | None = None,
                context_mask: Tensor | None = None, mems: list[Tensor] | None = None,
                mem_masks: list[Tensor] | Tensor | None = None, return_embeddings: bool = False,
                return_mems: bool = False, return_attn: bool = False,
                return_intermediates: bool = False, pos: Tensor | None = None,
                state: DecodeState | None = None, prefix_len: Tensor | int | None = None,
                embed_ids: dict[str, Tensor] | None = None, global_mask: Tensor | None = None,
                knn_clear: Tensor | None = None) -> Any:
        checks.token_ids(x, self.num_tokens)
        self._check_common(x.shape[1], x.shape[0], mask, mems, return_mems, return_attn, pos, state)
        if embed_ids is not None:
            if self.embeds is None:
                raise ValueError("embed_ids was given, but the model has no extra embeddings (embed_num_tokens)")
            self.embeds.check(embed_ids, x)
        h = self.embed(x, embed_ids)
        need = return_mems or return_attn or return_intermediates
        out, record, new_mems = self._run(h, mask, context, context_mask, mems, mem_masks, need, return_attn,
                                          pos, state, prefix_len, global_mask, knn_clear)
        return self._finish(out, record, new_mems, return_embeddings, return_mems, return_attn,
                            return_intermediates)


class ContinuousTransformerWrapper(SequenceWrapper):
    """Vectors in (b, n, dim_in), vectors out (b, n, dim_out); arguments as `TransformerWrapper`
    (`post_emb_norm` normalises the projected input plus absolute positions).

    allow_nonfinite: accept NaN / inf in the input instead of refusing it.
    """

    @checked_keywords
    def __init__(self, *, max_seq_len: int, attn_layers: AttentionLayers, dim_in: int | None = None,
                 dim_out: int | None = None, emb_dropout: float = 0.0,
                 num_memory_tokens: int | None = None, use_abs_pos_emb: bool | None = None,
                 scaled_sinu_pos_emb: bool = False, max_mem_len: int = 0, shift_mem_down: int = 0,
                 allow_nonfinite: bool = False, post_emb_norm: bool = False, abs_pos_per_layer: bool = False,
                 randomized_pos: int | None = None):
        super().__init__()
        stack = _stack(attn_layers, "ContinuousTransformerWrapper")
        dim = stack.dim
        self.dim_in = dim_in or dim
        self.project_in = nn.Linear(dim_in, dim) if dim_in is not None else None
        self.project_out = nn.Linear(stack.out_dim, dim_out) if dim_out is not None else None
        self.allow_nonfinite = allow_nonfinite
        self._setup(attn_layers=stack, max_seq_len=max_seq_len, emb_dropout=emb_dropout,
                    num_memory_tokens=num_memory_tokens, use_abs_pos_emb=use_abs_pos_emb,
                    scaled_sinu_pos_emb=scaled_sinu_pos_emb, max_mem_len=max_mem_len,
                    shift_mem_down=shift_mem_down, post_emb_norm=post_emb_norm, abs_pos_per_layer=abs_pos_per_layer,
                    randomized_pos=randomized_pos)

    def head(self, x: Tensor) -> Tensor:
        return self.project_out(x) if self.project_out is not None else x

    def forward(self, x: Tensor, mask: Tensor | None = None, context: Tensor | None = None,
                context_mask: Tensor | None = None, mems: list[Tensor] | None = None,
                mem_masks: list[Tensor] | Tensor | None = None, return_embeddings: bool = False,
                return_mems: bool = False, return_attn: bool = False,
                return_intermediates: bool = False, pos: Tensor | None = None,
                state: DecodeState | None = None, prefix_len: Tensor | int | None = None,
                global_mask: Tensor | None = None) -> Any:
        checks.floats("x", x, 3, "(batch, seq, dim_in)")
        if x.shape[-1] != self.dim_in:
            raise ValueError(f"x has feature size {x.shape[-1]}, expected dim_in={self.dim_in}")
        if not self.allow_nonfinite:
            checks.finite("x", x)
        self._check_common(x.shape[1], x.shape[0], mask, mems, return_mems, return_attn, pos, state)
        h = self.project_in(x) if self.project_in is not None else x
        need = return_mems or return_attn or return_intermediates
        out, record, new_mems = self._run(h, mask, context, context_mask, mems, mem_masks, need, return_attn,
                                          pos, state, prefix_len, global_mask)
        return self._finish(out, record, new_mems, return_embeddings, return_mems, return_attn,
                            return_intermediates)


class ViTransformerWrapper(nn.Module):
    """Images (b, channels, image_size, image_size) -> class logits (b, num_classes) from a class
    token, or the encoded patches (b, 1 + patches, dim) with `return_embeddings=True` or no head
    (arXiv:2010.11929)."""

    @checked_keywords
    def __init__(self, *, image_size: int, patch_size: int, attn_layers: AttentionLayers,
                 num_classes: int | None = None, channels: int = 3, dropout: float = 0.0,
                 emb_dropout: float = 0.0, allow_nonfinite: bool = False):
        super().__init__()
        stack = _stack(attn_layers, "ViTransformerWrapper")
        if patch_size < 1 or image_size % patch_size:
            raise ValueError(f"ViTransformerWrapper: patch_size ({patch_size}) must divide image_size ({image_size})")
        if stack.causal:
            raise ValueError("ViTransformerWrapper: attn_layers must be bidirectional (an Encoder), not a Decoder")
        if stack.has_cross:         # forward has no context to give them
            raise ValueError("ViTransformerWrapper: attn_layers must not have cross-attention blocks "
                             "(cross_attend / only_cross / custom_layers with 'c'): an image model has no context")
        dim = stack.dim
        self.image_size, self.channels = image_size, channels
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = PatchEmbedding(image_size, patch_size, channels, dim)
        self.pos_emb = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.dropout = nn.Dropout(emb_dropout)
        self.attn_layers = stack
        self.allow_nonfinite = allow_nonfinite
        self.mlp_head = None
        if num_classes is not None:
            self.mlp_head = nn.Sequential(nn.Dropout(dropout), nn.Linear(stack.out_dim, num_classes))

    def forward(self, img: Tensor, return_embeddings: bool = False) -> Tensor:
        checks.floats("img", img, 4, "(batch, channels, image_size, image_size)")
        expected = (self.channels, self.image_size, self.image_size)
        if tuple(img.shape[1:]) != expected:
            raise ValueError(f"img must have shape (batch, {', '.join(map(str, expected))}), got {tuple(img.shape)}")
        if not self.allow_nonfinite:
            checks.finite("img", img)
        x = self.patch_embed(img)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_emb
        x = self.attn_layers(self.dropout(x))
        if self.mlp_head is None or return_embeddings:
            return x
        return self.mlp_head(x[:, 0])
