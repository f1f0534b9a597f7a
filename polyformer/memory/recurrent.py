"""The recurrent kind of decode state: one attention block's fixed-size summary of every key so far
(Σ φ(k) vᵀ and Σ φ(k) of a kernel method, with its running maximum), whatever the kernel keeps. Its
size does not grow with the tokens fed; `history` summaries after the latest positions let a
speculative step's rejected tokens be rolled back exactly."""

from __future__ import annotations

from collections import deque

from torch import Tensor

Summary = dict[str, Tensor]     # the kernel's named tensors, batch first


class Recurrent:
    """A block's summary after every committed position, and during a step of `pending` positions
    the summary the step has written. The kernel reads `summary` (None: nothing fed yet), and calls
    `write(final, trailing)`: `final` after the step's last position, `trailing` (each tensor with a
    dim 1 of `wanted` positions, oldest first) after each of the step's last `wanted` positions, for
    rollback; None when `wanted` is 0."""

    def __init__(self, history: int):
        if history < 0:
            raise ValueError(f"history must be >= 0, got {history}")
        self.history = history
        self.summary: Summary | None = None
        self.pending = 0
        self._written: tuple[Summary, Summary | None] | None = None
        self._trail: deque[Summary | None] = deque([None], maxlen=history + 1)   # see commit

    @property
    def wanted(self) -> int:
        """How many trailing per-position summaries this step should report: to roll back `history`
        positions, the summaries after the last history + 1 (the step's earlier ones are kept)."""
        return min(self.pending, self.history + 1) if self.history else 0

    def begin(self, n: int) -> None:
        self.pending = n
        self._written = None

    def write(self, final: Summary, trailing: Summary | None) -> None:
        if self.wanted and trailing is None:
            raise ValueError(f"this decode state keeps {self.history} positions of history: the kernel must report "
                             "the summaries after each of the step's last positions")
        self._written = (final, trailing)

    def commit(self) -> None:
        """The step's summaries become the committed ones: `_trail[0]` is the summary after the latest
        position, `_trail[t]` the one t positions earlier (None: before the first position)."""
        if self._written is None:       # the block never ran this step
            self.pending = 0
            return
        final, trailing = self._written
        r = 0 if trailing is None else next(iter(trailing.values())).shape[1]
        if self.pending > r:            # earlier positions of the step have no summary of their own
            self._trail.clear()
        for t in range(r - 1):
            self._trail.appendleft({name: x[:, t] for name, x in trailing.items()})
        self._trail.appendleft(final)
        self.summary = final
        self.pending, self._written = 0, None

    def check_rollback(self, n: int) -> None:
        if n > len(self._trail) - 1:
            raise ValueError(f"a recurrent layer's decode state keeps the summaries of its last {self.history} "
                             f"positions and can roll back {len(self._trail) - 1} now, not {n} (make the state "
                             "with new_state(..., history=k))")

    def rollback(self, n: int) -> None:
        """Forget the last n positions: the summary after the position before them."""
        if n == 0:
            return
        self.check_rollback(n)
        for _ in range(n):
            self._trail.popleft()
        self.summary = self._trail[0]

    def reorder(self, indices: Tensor) -> None:
        def pick(s: Summary | None) -> Summary | None:
            return None if s is None else {name: x.index_select(0, indices) for name, x in s.items()}

        self.summary = pick(self.summary)
        self._trail = deque([pick(s) for s in self._trail], maxlen=self.history + 1)
        if self._trail:
            self._trail[0] = self.summary

    def clone(self) -> "Recurrent":
        new = Recurrent(self.history)
        copies = {}

        def copy(s: Summary | None) -> Summary | None:
            if s is None:
                return None
            if id(s) not in copies:
                copies[id(s)] = {name: x.clone() for name, x in s.items()}
            return copies[id(s)]

        new.summary = copy(self.summary)
        new._trail = deque([copy(s) for s in self._trail], maxlen=self.history + 1)
        new.pending = self.pending
        return new

    def saved(self, depth: int = 2) -> list[Summary | None]:
        """The summaries after the latest `depth` positions, latest first (None: before any position),
        for a prompt cache: with two, the loaded state can roll back one position."""
        return list(self._trail)[:depth]

    def restore(self, trail: list[Summary | None]) -> None:
        if len(trail) > self.history + 1:
            trail = trail[: self.history + 1]
        self._trail = deque(trail, maxlen=self.history + 1)
        self.summary = trail[0]

    def nbytes(self) -> int:
        """Bytes held: the summary and the history (each distinct tensor once)."""
        seen: dict[int, int] = {}
        for s in [self.summary, *self._trail]:
            for x in (s or {}).values():
                seen[id(x)] = x.numel() * x.element_size()
        return sum(seen.values())
