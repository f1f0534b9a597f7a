"""Token ids in, logits (or embeddings) out."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .. import checks
from ..embedding import ExtraEmbeddings, TokenEmbedding
from ..attention import hard_log_probs, z_loss
from ..keywords import checked_keywords
from ..memory.kv_cache import DecodeState
from ..stack import AttentionLayers
from . import cache as cache_mod
from . import inputs, outputs, pooling
from . import recycling as recycle
from .outputs import WrapperRecord
from .sequence import SequenceWrapper, _stack


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
        l2norm_embed: token (and learned position) embeddings scaled to unit l2 norm, from a small init
            (fixnorm, arXiv:1710.01329).
        emb_frac_gradient: only this fraction of the gradient flows into the embedding (arXiv:2105.13290).
        num_output_heads: that many separate output heads; the forward gives a tuple of logits.
        return_only_embed: no output head: the forward gives the stack's output.
        average_pool_embed: the output is the masked average over positions, (b, num_tokens).
        use_cls_token, num_cls_tokens (1): learned class tokens in front of the sequence; the output is
            theirs, (b, num_tokens) for one, (b, num_cls_tokens, num_tokens) for several.
        mixture_of_softmax, mixture_of_softmax_k (4): the output is log P of a mixture of k softmaxes
            (arXiv:1711.03953), not logits.
        recycling, train_max_recycle_steps (4): the stack runs several times, each run also given a
            projection of the previous run's output (AlphaFold2's recycling; wrap/recycling.py); training
            draws 1 .. train_max_recycle_steps runs, evaluation takes `recycle_steps=` on forward.
        memory_tokens_interspersed_every: m: the num_memory_tokens go before every m-th token, not once in front
            (Decoder only; wrap/interspersed.py).
        attn_pool, num_pooled_tokens (1), attn_pool_depth (1), dim_pooled_tokens (dim): learned queries
            cross-attend to the output (wrap/pooling.py); an Encoder gives the pooled tokens (b, k, dim_pooled)
            (its logits in the record), a Decoder its logits and, with return_intermediates, the record's
            attn_pooled_tokens (not when continuing a decode state).
        input_not_include_cache: with cache=, x holds only the new tokens (the forward's argument overrides it).

    forward(x (b, n) int, mask (b, n) bool, context, context_mask, mems, mem_masks,
    return_embeddings, return_mems, return_attn, return_intermediates, pos, state, prefix_len,
    embed_ids, knn_clear, attn_mask, seq_start_pos, prepend_embeds, prepend_mask, excise_prepend_embeds,
    sum_embeds, return_logit_entropies, cache, recycle_steps) -> logits (b, n, num_tokens), embeddings
    (b, n, dim), or a pair with the memories / attention maps / record (`WrapperRecord`). `pos` (b|1, n)
    overrides the token positions (per-row positions of a left-padded batch); `seq_start_pos` (b,) gives a
    left-padded batch by each row's first token (the padding is masked, positions start there); `state` (from
    `new_state`) makes x a continuation of the cached positions; `cache` (a record from
    return_intermediates=True) runs only the positions of x after the record's (wrap/cache.py); `prefix_len`
    (int or (b,), causal stacks) makes the first prefix_len tokens a bidirectional prefix (prefix-LM);
    `knn_clear` (b,) bool clears those rows' kNN memories first (knn_memory_layers: a new document).
    `attn_mask` (i, j) / (h, i, j) / (b, h, i, j) bool: which keys each query may see (stack.AttentionLayers).
    `prepend_embeds` (b, p, dim) with `prepend_mask` (b, p) go before the tokens (after the class tokens), at
    positions 0 .. p - 1, the tokens after them; their outputs stay in front unless excise_prepend_embeds.
    `sum_embeds` (b, n, emb_dim) is added to the token embedding. `return_logit_entropies` returns the record
    with `logit_entropies` (b, n). `return_logits_and_embeddings` gives (logits, embeddings).
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
                 cmem_ratio: int | None = None, cmem_fn: str | None = None, cmem_loss_weight: float | None = None,
                 l2norm_embed: bool = False, emb_frac_gradient: float = 1.0, num_output_heads: int = 1,
                 return_only_embed: bool = False, average_pool_embed: bool = False, use_cls_token: bool = False,
                 num_cls_tokens: int = 1, mixture_of_softmax: bool = False, mixture_of_softmax_k: int = 4,
                 recycling: bool = False, train_max_recycle_steps: int = 4,
                 memory_tokens_interspersed_every: int | None = None, attn_pool: bool = False,
                 num_pooled_tokens: int = 1, attn_pool_depth: int = 1, dim_pooled_tokens: int | None = None,
                 input_not_include_cache: bool = False, attn_z_loss_weight: float | None = None):
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
        heads = outputs.check_heads("TransformerWrapper", num_output_heads, {
            "num_output_heads > 1": num_output_heads != 1, "return_only_embed": return_only_embed,
            "mixture_of_softmax": mixture_of_softmax})
        if tie_embedding and heads > 1:
            raise ValueError("TransformerWrapper: tie_embedding=True gives one head; num_output_heads must be 1")
        on = [k for k, v in (("average_pool_embed", average_pool_embed), ("use_cls_token", use_cls_token),
                             ("attn_pool", attn_pool), ("return_only_embed", attn_pool and return_only_embed),
                             ("memory_tokens_interspersed_every", memory_tokens_interspersed_every is not None
                              and use_cls_token)) if v]
        if len(on) > 1:
            raise ValueError(f"TransformerWrapper: {' and '.join(on)} cannot be combined")
        self.num_tokens = num_tokens
        self.token_emb = (inputs.L2NormTokenEmbedding if l2norm_embed else TokenEmbedding)(num_tokens, emb_dim)
        self.project_emb = nn.Linear(emb_dim, dim) if emb_dim != dim else None
        self.embeds = ExtraEmbeddings(embed_num_tokens, dim) if embed_num_tokens else None
        self._setup(attn_layers=stack, max_seq_len=max_seq_len, emb_dropout=emb_dropout,
                    num_memory_tokens=num_memory_tokens, use_abs_pos_emb=use_abs_pos_emb,
                    scaled_sinu_pos_emb=scaled_sinu_pos_emb, max_mem_len=max_mem_len,
                    shift_mem_down=shift_mem_down, post_emb_norm=post_emb_norm, post_emb_proj=post_emb_proj,
                    axial_pos_emb=axial_pos_emb, axial_pos_emb_dims=axial_pos_emb_dims,
                    abs_pos_per_layer=abs_pos_per_layer, randomized_pos=randomized_pos,
                    cmem=(max_cmem_len, cmem_ratio, cmem_fn, cmem_loss_weight),
                    interspersed_every=memory_tokens_interspersed_every)
        self.attn_pool = pooling.AttentionPool.build("TransformerWrapper", attn_pool, num_pooled_tokens,
                                                     attn_pool_depth, dim_pooled_tokens, stack)
        self.input_not_include_cache = cache_mod.check_flag("TransformerWrapper", input_not_include_cache)
        self.attn_z_loss_weight = z_loss.check_weight("TransformerWrapper", attn_z_loss_weight)   # attention/z_loss.py
        if attn_z_loss_weight is not None:
            z_loss.check("TransformerWrapper", stack)
        if l2norm_embed:
            self.pos_emb = inputs.l2norm_positions(self.pos_emb)
        self.emb_frac_gradient = inputs.check_fraction("TransformerWrapper", emb_frac_gradient)
        self.tie_embedding = tie_embedding
        self.return_only_embed = return_only_embed
        self.average_pool_embed = average_pool_embed
        self.cls_tokens = inputs.class_tokens("TransformerWrapper", use_cls_token, num_cls_tokens, dim)
        self.recycling = recycle.Recycling.build("TransformerWrapper", recycling, train_max_recycle_steps, stack)
        out_features = logits_dim or num_tokens
        self.to_logits = (None if tie_embedding or return_only_embed or heads > 1
                          else nn.Linear(stack.out_dim, out_features, bias=logits_bias))
        self.output_heads = (nn.ModuleList(nn.Linear(stack.out_dim, out_features, bias=logits_bias)
                                           for _ in range(heads)) if heads > 1 else None)
        self.mixture = (outputs.MixtureOfSoftmaxes(stack.out_dim, checks.count(
            mixture_of_softmax_k, "TransformerWrapper: mixture_of_softmax_k")) if mixture_of_softmax else None)

    def project(self, x: Tensor) -> Tensor:
        """x (..., dim) -> logits (..., num_tokens): the tied embedding or the output layer."""
        if self.to_logits is None:
            return x @ self.token_emb.weight.t()
        return self.to_logits(x)

    def head(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        if self.return_only_embed:
            return x
        if self.output_heads is not None:
            return tuple(head(x) for head in self.output_heads)
        if self.mixture is not None:
            return self.mixture(x, self.project)
        return self.project(x)

    def embed(self, x: Tensor, embed_ids: dict[str, Tensor] | None = None, sum_embeds: Tensor | None = None) -> Tensor:
        """Token ids (b, n) -> (b, n, dim): the token embedding (plus sum_embeds), projected from emb_dim, plus
        the extra embeddings (their id 0 where `embed_ids` does not give one)."""
        h = inputs.summed(self.token_emb(x), sum_embeds)
        if self.project_emb is not None:
            h = self.project_emb(h)
        if self.embeds is not None:
            h = self.embeds(h, embed_ids or {})
        return h

    def add_positions(self, h: Tensor, tok_pos: Tensor) -> Tensor:
        return super().add_positions(h, tok_pos, self.emb_frac_gradient)

    def forward(self, x: Tensor, mask: Tensor | None = None, context: Tensor | None = None,
                context_mask: Tensor | None = None, mems: list[Tensor] | None = None,
                mem_masks: list[Tensor] | Tensor | None = None, return_embeddings: bool = False,
                return_mems: bool = False, return_attn: bool = False,
                return_intermediates: bool = False, pos: Tensor | None = None,
                state: DecodeState | None = None, prefix_len: Tensor | int | None = None,
                embed_ids: dict[str, Tensor] | None = None, global_mask: Tensor | None = None,
                knn_clear: Tensor | None = None, attn_mask: Tensor | None = None,
                seq_start_pos: Tensor | None = None, prepend_embeds: Tensor | None = None,
                prepend_mask: Tensor | None = None, excise_prepend_embeds: bool = False,
                sum_embeds: Tensor | None = None, return_logit_entropies: bool = False,
                cache: WrapperRecord | None = None, recycle_steps: int | None = None,
                return_logits_and_embeddings: bool = False, input_not_include_cache: bool | None = None,
                return_attn_z_loss: bool = False, attn_z_loss_weight: float | None = None,
                return_gumbel_log_probs: bool = False) -> Any:
        if return_attn_z_loss:      # (out, record with attn_z_loss): attention/z_loss.py
            return z_loss.returned(self, dict(locals()))
        if return_gumbel_log_probs:     # (out, record with gumbel_log_probs): attention/hard_log_probs.py
            return hard_log_probs.returned(self, self.attn_layers, dict(locals()))
        checks.token_ids(x, self.num_tokens)
        given = dict(mask=mask, global_mask=global_mask, sum_embeds=sum_embeds, embed_ids=embed_ids)
        if cache_mod.excludes(cache, input_not_include_cache, self.input_not_include_cache):
            x, pos, given = cache_mod.joined(cache, x, pos, given)     # the record's inputs, then x
            mask, global_mask, sum_embeds, embed_ids = given.values()
        b, n = x.shape
        mask, pos = inputs.left_padding(seq_start_pos, mask, pos, b, n, x.device)
        given["mask"] = mask
        if return_logits_and_embeddings and (return_embeddings or self.return_only_embed):
            raise ValueError("return_logits_and_embeddings gives both; it cannot combine with return_embeddings or a "
                             "model built with return_only_embed")
        if cache is not None:
            out, record = cache_mod.cached(
                self, x, pos, given,
                dict(context=context, context_mask=context_mask, return_embeddings=return_embeddings,
                     return_attn=return_attn, prefix_len=prefix_len, knn_clear=knn_clear, excise_prepend_embeds=True,
                     return_logit_entropies=return_logit_entropies, recycle_steps=recycle_steps,
                     return_logits_and_embeddings=return_logits_and_embeddings, input_not_include_cache=False),
                dict(prepend_embeds=prepend_embeds, prepend_mask=prepend_mask), cache, state, self.num_cls_tokens)
            return (out, record) if return_intermediates or return_logit_entropies else out
        self._check_common(n, b, mask, mems, return_mems, return_attn, pos, state)
        if embed_ids is not None:
            if self.embeds is None:
                raise ValueError("embed_ids was given, but the model has no extra embeddings (embed_num_tokens)")
            self.embeds.check(embed_ids, x)
        h = self.embed(x, embed_ids, sum_embeds)
        front = inputs.front(self.cls_tokens, prepend_embeds, prepend_mask, b, self.attn_layers.dim)
        if state is not None and state.length and self.cls_tokens is not None:
            front = None                  # the class tokens are in the state, from its first step
        need = return_mems or return_attn or return_intermediates or return_logit_entropies
        run = lambda h: self._run(h, mask, context, context_mask, mems, mem_masks, need, return_attn,  # noqa: E731
                                  pos, state, prefix_len, global_mask, knn_clear, attn_mask, front)
        if self.recycling is not None and state is not None:
            raise ValueError("recycling=True runs the stack several times, so it cannot continue a decode state")
        out, record, new_mems = recycle.run(self.recycling, h, run, recycle_steps, self.training)
        joined = inputs.joined_mask(front, mask, b, n, x.device)
        out = outputs.pool(out, self.num_cls_tokens, self.average_pool_embed, joined)
        encoder = not self.attn_layers.causal            # an Encoder's output is its pooled tokens (wrap/pooling.py)
        pooled = (self.attn_pool(out, joined) if self.attn_pool is not None and state is None
                  and (encoder or return_intermediates) else None)
        if front is not None and excise_prepend_embeds and not self.num_cls_tokens:
            out = out[:, front.h.shape[1]:]
        logits = None if return_embeddings else self.head(out)
        result = (logits, out) if return_logits_and_embeddings else out if return_embeddings else logits
        if pooled is not None and encoder and logits is not None and not return_logits_and_embeddings:
            result = pooled
        if return_intermediates or return_logit_entropies:
            record = outputs.WrapperRecord.of(record)
            record.mems = new_mems if new_mems is not None else record.mems
            record.cache_length = n if state is None else None
            record.inputs = (x, pos, given) if state is None else None
            record.attn_pooled_tokens, record.logits = pooled, logits if pooled is not None else None
            if return_logit_entropies and logits is not None:
                record.logit_entropies = outputs.entropies(logits)
            return result, record
        return self._finish(result, record, new_mems, True, return_mems, return_attn, False)

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, history: int = 1) -> DecodeState:
        pooled = [name for name, on in (("average_pool_embed", self.average_pool_embed),
                                        ("use_cls_token", self.cls_tokens is not None),
                                        ("recycling", self.recycling is not None)) if on]
        if pooled:
            raise ValueError(f"TransformerWrapper: a model built with {', '.join(pooled)} gives no per-token "
                             "continuation to decode (one output per sequence, or a stack run several times)")
        return super().new_state(batch, max_len, dtype, device, history)

    @property
    def num_cls_tokens(self) -> int:
        return self.cls_tokens.shape[0] if self.cls_tokens is not None else 0
