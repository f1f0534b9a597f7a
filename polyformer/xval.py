"""xVal (arXiv:2310.02989): a number enters a token model as one [NUM] token whose embedding is scaled by the
number's value, and leaves it through a number head that regresses the value at every position."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from . import checks
from .embedding import TokenEmbedding
from .keywords import checked_keywords
from .memory.kv_cache import DecodeState
from .stack import AttentionLayers
from .wrap import inputs
from .wrap.sequence import SequenceWrapper, _stack


class XValTransformerWrapper(SequenceWrapper):
    """Token ids and their numbers in, (logits, numbers) out (xVal, arXiv:2310.02989).

    Args:
        num_tokens: vocabulary size, [NUM] included.
        max_seq_len: longest sequence for learned absolute positions.
        numerical_token_id: the id of [NUM]; its embedding is multiplied by the number the position carries.
        attn_layers: an `Encoder`, `Decoder` or `AttentionLayers`.
        emb_dim: token embedding size when it differs from the stack's dim (projected in without a bias, so a
            [NUM] embedding stays proportional to its value).
        logits_dim: size of the output logits when it differs from num_tokens.
        tie_embedding: logits are h @ E^T * dim^-0.5 with E the token embedding (as x-transformers' xVal).
        max_mem_len, num_memory_tokens, emb_dropout, use_abs_pos_emb, scaled_sinu_pos_emb: as `TransformerWrapper`.

    forward(x (b, n) ids, x_num (b, n) floats, mask, context, context_mask, mems, mem_masks, pos, state,
    prepend_embeds, prepend_mask, return_embeddings, return_mems, return_attn, return_intermediates) ->
    (logits (b, n, logits_dim), numbers (b, n)), or the stack's output (b, n, dim) with return_embeddings; x_num
    is read only where x is [NUM] (elsewhere it may hold anything, NaN included).
    """

    @checked_keywords
    def __init__(self, *, num_tokens: int, max_seq_len: int, numerical_token_id: int, attn_layers: AttentionLayers,
                 emb_dim: int | None = None, logits_dim: int | None = None, tie_embedding: bool = False,
                 max_mem_len: int = 0, num_memory_tokens: int | None = None, emb_dropout: float = 0.0,
                 use_abs_pos_emb: bool | None = None, scaled_sinu_pos_emb: bool = False):
        super().__init__()
        owner = "XValTransformerWrapper"
        stack = _stack(attn_layers, owner)
        dim = stack.dim
        num_tokens = checks.count(num_tokens, f"{owner}: num_tokens")
        numerical_token_id = checks.count(numerical_token_id, f"{owner}: numerical_token_id", 0)
        if numerical_token_id >= num_tokens:
            raise ValueError(f"{owner}: numerical_token_id must be a token id in [0, num_tokens={num_tokens}), "
                             f"got {numerical_token_id}")
        emb_dim = dim if emb_dim is None else checks.count(emb_dim, f"{owner}: emb_dim")
        logits_dim = num_tokens if logits_dim is None else checks.count(logits_dim, f"{owner}: logits_dim")
        if not isinstance(tie_embedding, bool):
            raise TypeError(f"{owner}: tie_embedding must be True or False, got {tie_embedding!r}")
        if tie_embedding and (emb_dim != dim or logits_dim != num_tokens or stack.out_dim != dim):
            raise ValueError(f"{owner}: tie_embedding=True needs emb_dim == dim, logits_dim == num_tokens and a stack "
                             "whose output has dim features")
        self.num_tokens = num_tokens
        self.numerical_token_id = numerical_token_id
        self.token_emb = TokenEmbedding(num_tokens, emb_dim)
        self.project_emb = nn.Linear(emb_dim, dim, bias=False) if emb_dim != dim else None
        self._setup(attn_layers=stack, max_seq_len=max_seq_len, emb_dropout=emb_dropout,
                    num_memory_tokens=num_memory_tokens, use_abs_pos_emb=use_abs_pos_emb,
                    scaled_sinu_pos_emb=scaled_sinu_pos_emb, max_mem_len=max_mem_len, shift_mem_down=0)
        self.to_logits = None if tie_embedding else nn.Linear(stack.out_dim, logits_dim)
        self.to_number = nn.Linear(stack.out_dim, 1)

    def embed(self, x: Tensor, x_num: Tensor) -> Tensor:
        """ids (b, n), numbers (b, n) -> (b, n, dim): the token embedding, times the number where x is [NUM]."""
        h = self.token_emb(x)
        scale = torch.where(x == self.numerical_token_id, x_num.to(h.dtype), torch.ones((), dtype=h.dtype,
                                                                                         device=h.device))
        h = h * scale[..., None]
        return self.project_emb(h) if self.project_emb is not None else h

    def head(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(b, n, dim) -> (logits (b, n, logits_dim), numbers (b, n))."""
        if self.to_logits is None:
            logits = x @ self.token_emb.weight.t() * x.shape[-1] ** -0.5
        else:
            logits = self.to_logits(x)
        return logits, self.to_number(x).squeeze(-1)

    def check_numbers(self, x: Tensor, x_num: object, name: str = "x_num") -> Tensor:
        """x_num (b, n) floats beside the ids x, finite where x is [NUM]."""
        x_num = checks.tensor(name, x_num)
        if not x_num.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating point tensor, got dtype {x_num.dtype}")
        if x_num.shape != x.shape:
            raise ValueError(f"{name} must have the shape of the token ids {tuple(x.shape)}, got {tuple(x_num.shape)}")
        if not checks.values_hidden() and not bool(torch.isfinite(x_num[x == self.numerical_token_id]).all()):
            raise ValueError(f"{name} holds NaN or inf at a [NUM] position (numerical_token_id="
                             f"{self.numerical_token_id})")
        return x_num

    def forward(self, x: Tensor, x_num: Tensor, return_embeddings: bool = False, return_intermediates: bool = False,
                return_mems: bool = False, mask: Tensor | None = None, return_attn: bool = False,
                mems: list[Tensor] | None = None, pos: Tensor | None = None, prepend_embeds: Tensor | None = None,
                prepend_mask: Tensor | None = None, context: Tensor | None = None, context_mask: Tensor | None = None,
                mem_masks: list[Tensor] | Tensor | None = None, state: DecodeState | None = None) -> Any:
        checks.token_ids(x, self.num_tokens)
        x_num = self.check_numbers(x, x_num)
        b, n = x.shape
        self._check_common(n, b, mask, mems, return_mems, return_attn, pos, state)
        front = inputs.front(None, prepend_embeds, prepend_mask, b, self.attn_layers.dim)
        need = return_mems or return_attn or return_intermediates
        out, record, new_mems = self._run(self.embed(x, x_num), mask, context, context_mask, mems, mem_masks, need,
                                          return_attn, pos, state, front=front)
        return self._finish(out, record, new_mems, return_embeddings, return_mems, return_attn, return_intermediates)
