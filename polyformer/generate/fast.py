"""The one-token decode step as a flat loop over the blocks, for the decoders most people run.

A cached step through the module tree (`net(token, state=state)`) pays for generality on every
token: argument checks, a `Context`, a `Block` per sublayer, the keep-mask memo, module calls.
At batch 1 on a CPU that is about a millisecond per token for a six-layer model, as much as the
arithmetic of a small one. `FastStep` runs the same operations in the same order, calling the same
modules and kernels (norms, projections, activations, rotary, score biases, the attention kernel,
the decode state), without the machinery, so its logits are bit-identical to the module path's
(tests/generate/test_fast.py checks it for every decoder option, left-padded batches included).

It covers stacks of self-attention and feedforward blocks with every norm placement, residual,
norm, activation, position, score bias, attention kernel option (fused or not: top-k, entmax,
talking heads, residual attention), token shift, memory tokens and key / values, MQA / GQA and
head; quantized or re-laid-out linear layers too. Cross-attention, collaborative or
position-infused heads, hooks on a module, training mode and any block branch it does not know
exactly (a feedforward or mixer of another class, a direct kernel) make `FastStep.unsupported(net)`
name the reason, and generation keeps the module path.

`fast_step(net)`, what generate / stream / beam search / speculative decoding run by default, is a
tuned FastStep: the common blocks as `plan.PlainBlock`s over input-major copies of the expanding
weights (`plan.DecodeLayout`), and a stack made only of them as `rows.Rows` (2-D rows, preallocated
buffers, one call per layer), equal to the module path up to float rounding. At dim 512 / depth 6,
batch 1, 144 cached positions this cut the step's time outside the weight products and attention
from 1.18-1.25 ms to 0.72-0.78 ms (0.92-0.96 to 0.42-0.53 ms against the products and attention run
in the step's order; `benchmarks/generation_extra.py`, process time). The block loop in C++ (`native.py`)
and a prelude without per-step re-checks (the state's batch and layers once per state, token ids by the
embedding lookup's own bounds check, then named) took it to 0.41-0.54 ms (0.04-0.19 ms in order), on a
loaded machine where the Python loop measured 1.05-1.10 (0.74); most of what is left is the attention
reading its keys cold after the weights streamed (95 us a layer in the step, 35 alone).
"""

from __future__ import annotations

from typing import Callable

import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks

from .. import checks
from . import plan, rows
from ..attention.attention import Attention
from ..attention.projection import Projection, split_heads
from ..embedding import LearnedPositions, TokenEmbedding
from ..feedforward import FeedForward
from ..interfaces import KV
from ..memory.kv_cache import DecodeState
from ..stack import AttentionLayers, Block, Decoder, Encoder
from ..wrappers import TransformerWrapper


def _hooked(model: nn.Module) -> bool:
    if any(getattr(module_hooks, name, None) for name in
           ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called")):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# the parts the step runs, per module; any other child (a stage added later) sends the model to the module path
KNOWN = {
    TransformerWrapper: {"token_emb", "pos_emb", "post_emb_norm", "post_emb_proj", "emb_dropout", "memory_tokens",
                         "attn_layers", "to_logits", "project_emb", "embeds"},
    **dict.fromkeys((AttentionLayers, Decoder, Encoder), {"blocks", "final_norm", "shared_bias", "early_exit"}),
    Block: {"branch", "combine", "norm_in", "norm_out", "post_norm", "shift"},
    Attention: {"project", "position", "kernel", "output", "memory_kv"},
    FeedForward: {"proj_in", "act", "dropout", "proj_out"},
}


def _unknown(module: nn.Module) -> str | None:
    """Why `module` is not one the step knows exactly: another class, or a child it would skip."""
    known = KNOWN.get(type(module))
    if known is None:
        return f"a {type(module).__name__} (the fast step knows {', '.join(c.__name__ for c in KNOWN)})"
    extra = sorted(name for name, _ in module.named_children() if name not in known)
    return f"a {type(module).__name__} with parts the fast step would skip: {extra}" if extra else None


def _call(module: nn.Module | None) -> Callable | None:
    """`module.forward`: the module without nn.Module's call machinery (hooks are refused beforehand)."""
    return module.forward if module is not None else None


class _Block:
    """One block's stages, resolved to callables once per generate call."""

    def __init__(self, block: nn.Module, layout: plan.DecodeLayout | None = None):
        self.block = block
        self.attention = block.kind == "a"
        self.norm_in = _call(block.norm_in)
        self.plain_join = plan.plain_join(block)
        branch = block.branch
        if self.attention:
            project = branch.project
            self.qkv, self.split = plan.linear(project.to_qkv, layout), project.split
            self.heads = (project.heads, project.kv_heads, project.v_heads)
            self.position = _call(branch.position)
            self.layer, self.kernel = branch.layer, branch.kernel.forward
            self.memory_kv = _call(branch.memory_kv)
            self.output = branch.output.forward
        else:
            self.proj_in, self.proj_out = plan.linear(branch.proj_in, layout), plan.linear(branch.proj_out, layout)
            self.act = _call(branch.act)
            self.glu = branch.glu

    def __call__(self, x: Tensor, pos: Tensor, state: DecodeState, masks: Callable,
                 prev_scores: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The block's output, and the attention scores a later block adds (residual attention)."""
        h = self.norm_in(x) if self.norm_in is not None else x
        if self.block.shift is not None:
            h = self.block.shifted(h, state)
        if self.attention:
            q, k, v = self.qkv(h).split(self.split, dim=-1)
            heads, kv_heads, v_heads = self.heads
            q, k, v = split_heads(q, heads), split_heads(k, kv_heads), split_heads(v, v_heads)
            if self.position is not None:
                q, k = self.position(q, k, pos, pos)
            kv = KV(*state.write(self.layer, k, v), pos=None, mask=None)
            if self.memory_kv is not None:     # learned key / values before the cached ones
                kv = self.memory_kv(kv)
            keep, bias = masks(kv.free)
            attended = self.kernel(q, kv, mask=keep, bias=bias, causal=False, prev_scores=prev_scores)
            y, prev_scores = self.output(attended.out, h), attended.scores
        else:                                   # eval mode: dropout is the identity
            y = FeedForward.compute(h, self.proj_in, self.act, self.proj_out, self.glu)
        return (x + y if self.plain_join else self.block.join(x, y)), prev_scores


class FastStep:
    """`step(token (b, 1), state=state)` -> logits (b, 1, v), equal to `net(token, state=state)` for
    a net that `unsupported` accepts, on a state that already holds the prompt: bit-identical, or with
    `tuned` (the default decode path) up to float rounding, over the plan's blocks and weight layout.
    Build one per generate call: it holds the modules' tensors as they are when it is made."""

    def __init__(self, net: TransformerWrapper, tuned: bool = False):
        reason = self.unsupported(net)
        if reason is not None:
            raise ValueError(f"net: the fast decode step does not cover this model: {reason}")
        self.net = net
        stack = net.attn_layers
        layout = plan.layout_for(net) if tuned else None
        self.blocks = [(tuned and plan.PlainBlock.build(block, layout)) or _Block(block, layout)
                       for block in stack.blocks]
        self.final_norm = _call(stack.final_norm)
        self.memory_tokens = net.num_memory_tokens
        self.score_bias = _call(stack.shared_bias)
        self.head = plan.linear(net.to_logits, layout) if net.to_logits is not None else net.head
        self.rows = rows.Rows.build(self.blocks, layout) if tuned else None
        self.bounded, self.lookup = net.bounded, _lookup(net)
        self.checked: DecodeState | None = None     # the state whose batch and layers passed the checks
        self.direct = self.rows is not None and type(self).run is FastStep.run

    @staticmethod
    def unsupported(net: nn.Module) -> str | None:
        """Why the fast step cannot run `net` exactly, or None when it can."""
        if type(net) is not TransformerWrapper:
            return f"{type(net).__name__} (only TransformerWrapper)"
        if net.training:
            return "training mode (dropout)"
        stack = net.attn_layers
        if stack.cfg.reversible:
            return "reversible layers (two residual streams, reversible.py)"
        if stack.universal is not None:
            return "universal=True (the shared blocks run once per step, universal.py)"
        if stack.hourglass is not None:
            return "hourglass (layers at several resolutions, hourglass.py)"
        if stack.early_exit is not None and stack.early_exit.running:
            return "early exit while generating (tokens stop at different layers, early_exit.py)"
        if stack.layer_pos is not None:
            return "per-layer absolute positions (abs_pos_per_layer, position/per_layer_abs.py)"
        if stack.has_cross or any(kind not in ("a", "f") for kind in stack.layout):
            return "cross-attention"
        for block in stack.blocks:
            if block.kind == "f" and type(block.branch) is not FeedForward:
                return f"a feedforward of type {type(block.branch).__name__}"
            if block.kind == "a":
                attn = block.branch
                if not isinstance(attn, Attention):
                    return f"a mixer ({type(attn).__name__}) in place of attention"
                if attn.direct:
                    return "an attention kernel of its own (attn_performer, attn_linear, ...)"
                if attn.relative is not None:
                    return "a relative position scheme (rel_pos_shaw, rel_pos_xl: position/relative.py)"
                if attn._bias and attn._bias[0] is not stack.shared_bias:
                    return "a score bias that is not the stack's own"
                if not isinstance(attn.project, Projection):
                    return f"a projection of its own ({type(attn.project).__name__})"
                if attn.project.infusion is not None or attn.project.mixing is not None:
                    return "position-infused or collaborative heads"
                if attn.pattern is not None:
                    return "an attention pattern (attn_window, attn_sparse, ...)"
        for part in (net, stack, *stack.blocks, *(block.branch for block in stack.blocks)):
            reason = _unknown(part)
            if reason is not None:
                return reason
        if _hooked(net):
            return "a forward hook on a module"
        return None

    def __call__(self, x: Tensor, *, state: DecodeState, context: Tensor | None = None,
                 context_mask: Tensor | None = None) -> Tensor:
        if context is not None or context_mask is not None:
            raise ValueError("context: the model has no cross-attention")
        net = self.net
        if x.ndim != 2 or x.shape[1] != 1 or state.length == 0:
            raise ValueError(f"the fast step takes one new token per row of a state holding the prompt; got x "
                             f"{tuple(x.shape)} for a state holding {state.length}")
        if state is not self.checked or x.shape[0] != state.k.shape[1] or state.length >= state.k.shape[3]:
            checks.decode_state(net.attn_layers, state, x, None)     # batch, layers, room: as the module path
            self.checked = state
        pos = state.pos[:, state.length - 1: state.length] + 1            # (b, 1): after each row's last
        tok_pos = pos - self.memory_tokens if self.memory_tokens else pos  # memory tokens lead the state
        if self.bounded and int(tok_pos.max()) >= net.max_seq_len:
            checks.seq_len(int(tok_pos.max()) + 1, net.max_seq_len)
        h = self.embed(x, tok_pos)
        state.begin(pos, None)
        end = state.length + 1
        keep = state.mask[:, None, None, :end] if state.padded else None
        bias = self.score_bias(pos, state.pos[:, :end]) if self.score_bias is not None else None
        if self.direct and self.rows.takes(h):         # the common case without the closure below
            h = self.rows(h, pos, state, keep, bias)
            state.commit()
            return self.head(self.final_norm(h) if self.final_norm is not None else h)
        made: dict[int, tuple[Tensor | None, Tensor | None]] = {}

        def masks(free: int) -> tuple[Tensor | None, Tensor | None]:
            """The kernel's keep-mask and score bias as an attention block makes them for one new
            token (the stack's bias is one module, the same for every block), with `free` memory
            keys in front: kept, unbiased."""
            if free not in made:
                padded_keep = F.pad(keep, (free, 0), value=True) if keep is not None and free else keep
                padded_bias = F.pad(bias, (free, 0)) if bias is not None and free else bias
                made[free] = (padded_keep, padded_bias)
            return made[free]

        h = self.run(h, pos, state, keep, bias, masks)
        state.commit()
        if self.final_norm is not None:
            h = self.final_norm(h)
        return self.head(h)

    def run(self, h: Tensor, pos: Tensor, state: DecodeState, keep: Tensor | None, bias: Tensor | None,
            masks: Callable) -> Tensor:
        """The blocks on the new tokens' stream h (b, 1, dim), their keys / values written to the (begun) state;
        keep / bias: the key mask and score bias, `masks(free)` those with `free` memory keys in front."""
        if self.rows is not None and self.rows.takes(h):
            return self.rows(h, pos, state, keep, bias)
        prev: Tensor | None = None
        for block in self.blocks:
            h, scores = block(h, pos, state, masks, prev)
            if block.attention:
                prev = scores
        return h

    def embed(self, x: Tensor, tok_pos: Tensor) -> Tensor:
        """x (b, 1) -> the embedded stream (b, 1, dim) at tok_pos, as the module path makes it; with the plain
        tables, their lookups alone (an id outside the vocabulary fails the lookup, then the check names it)."""
        net = self.net
        if self.lookup is None or x.device.type != "cpu":     # elsewhere a bad id is no exception to catch
            checks.token_ids(x, net.num_tokens)
            if self.lookup is None:
                return net.add_positions(net.embed(x), tok_pos)
        tokens, positions = self.lookup
        try:
            h = F.embedding(x, tokens)
        except (IndexError, RuntimeError):
            checks.token_ids(x, net.num_tokens)
            raise
        return h + F.embedding(tok_pos, positions) if positions is not None else h


def _lookup(net: TransformerWrapper) -> tuple[Tensor, Tensor | None] | None:
    """(token table, position table or None) when the embedding is those lookups summed (eval mode: no
    dropout), else None: then `net.embed` / `net.add_positions` run."""
    emb, pos = net.token_emb, net.pos_emb
    plain = (type(emb) is TokenEmbedding and emb.padding_idx is None and emb.max_norm is None
             and net.project_emb is None and net.embeds is None and net.post_emb_norm is None
             and net.post_emb_proj is None and (pos is None or type(pos) is LearnedPositions))
    if not plain:
        return None
    return emb.weight, (pos.emb.weight if pos is not None else None)


def fast_step(net: nn.Module) -> FastStep | None:
    """The default one-token step: a tuned `FastStep` for `net`, or None when it needs the module path."""
    return FastStep(net, tuned=True) if FastStep.unsupported(net) is None else None
