"""One block of the layer stack: a branch (attention, a mixer or a feedforward) joined to the residual
stream by its norms, token shift, scale and residual policy."""

from __future__ import annotations

from torch import Tensor, nn

from .interfaces import AttnOut, Context
from .memory.kv_cache import DecodeState
from .shift import TokenShift


class Block(nn.Module):
    """norm -> shift -> branch -> (scale, sandwich norm) -> residual -> post-norm."""

    def __init__(self, kind: str, branch: nn.Module, combine: nn.Module, norm_in: nn.Module | None,
                 norm_out: nn.Module | None, post_norm: nn.Module | None, shift: TokenShift | None,
                 scale: float = 1.0, index: int = 0):
        super().__init__()
        self.kind = kind
        self.index = index
        self.branch = branch
        self.combine = combine
        self.norm_in = norm_in
        self.norm_out = norm_out
        self.post_norm = post_norm
        self.shift = shift
        self.scale = scale
        self.takes_context = getattr(branch, "takes_context", False)    # a feedforward that reads ctx

    def forward(self, x: Tensor, ctx: Context, prev_scores: Tensor | None
                ) -> tuple[Tensor, AttnOut | None, Tensor]:
        y, attn, h = self.step(x, ctx, prev_scores)
        return self.join(x, y), attn, h

    def step(self, x: Tensor, ctx: Context, prev_scores: Tensor | None, whole: bool = True
             ) -> tuple[Tensor, AttnOut | None, Tensor]:
        """The branch on the stream x: (its output y before the residual, its AttnOut or None, the input h
        it read after the norm and token shift). `whole=False` runs a feedforward on x as one piece even
        with ff_chunks (a reversible backward recomputes it piece by piece itself)."""
        inject = ctx.memo.get("reinject_input")    # reinject_input: W x0 joins the branch input (stack_policies.py)
        h = x if inject is None else x + inject
        h = self.norm_in(h) if self.norm_in is not None else h
        if self.shift is not None:
            h = self.shifted(h, ctx.state) if ctx.state is not None else self.shift(h, ctx.shift_mask)
        if self.kind == "f":
            if self.takes_context:          # reports losses, reads the state (moe/)
                return self.branch(h, ctx), None, h
            return (self.branch(h) if whole else self.branch.dense(h)), None, h
        attn = self.branch(h, ctx, prev_scores)
        return attn.out, attn, h

    def shifted(self, h: Tensor, state: DecodeState) -> Tensor:
        """Token shift while decoding: it reaches back into earlier steps' inputs, kept in the state."""
        window, window_mask = state.shift_window(self.index, h, self.shift.reach)
        return self.shift(window, window_mask)[:, -h.shape[1]:]

    def join(self, x: Tensor, y: Tensor) -> Tensor:
        """The branch output y back into the residual stream x: scale, sandwich norm, residual, post-norm."""
        if self.scale != 1.0:
            y = y * self.scale
        if self.norm_out is not None:
            y = self.norm_out(y)
        x = self.combine(x, y)
        if self.post_norm is not None:
            x = self.post_norm(x)
        return x
