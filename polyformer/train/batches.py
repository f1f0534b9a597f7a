"""Random windows of a token stream, drawn statelessly: batch k is a function of (seed, k) alone,
so resuming needs only the step, and every rank of a distributed run draws the same global batch
and keeps its own rows."""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor


def batch_seed(seed: int, k: int) -> int:
    """A 63-bit generator seed for batch k of a stream, the same in every process."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{k}".encode()).digest()[:8], "big") >> 1


def integer_at_least(name: str, value: object, minimum: int = 1) -> int:
    """`value` if it is an int (not a bool) >= minimum, else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def checked_rank(rank: object, world_size: int) -> int:
    """`rank` if it is an int in [0, world_size), else a ValueError."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
    return rank


class Batches:
    """Batches of `seq_len + 1` consecutive tokens (input and shifted target) at random offsets.

    Args:
        tokens: (N,) integer token stream, N >= seq_len + 1.
        seq_len: tokens the model sees per row; rows hold seq_len + 1.
        batch_size: the global batch; each rank gets batch_size // world_size rows.
        seed: with the step k, fixes batch k.
        rank, world_size: this process takes rows rank::world_size of the global batch, so the
            ranks together see exactly what one process with the whole batch sees.

    Iterating yields (batch_size // world_size, seq_len + 1) long tensors on tokens' device;
    `state_dict()` / `load_state_dict()` carry the step.
    """

    def __init__(self, tokens: Tensor, seq_len: int, batch_size: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        if not isinstance(tokens, Tensor) or tokens.ndim != 1 or tokens.dtype.is_floating_point \
                or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be a 1-d integer tensor, got "
                             f"{tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__}")
        self.seq_len = integer_at_least("seq_len", seq_len)
        self.batch_size = integer_at_least("batch_size", batch_size)
        self.world_size = integer_at_least("world_size", world_size)
        self.rank = checked_rank(rank, world_size)
        if batch_size % world_size:
            raise ValueError(f"batch_size ({batch_size}) must be a multiple of world_size ({world_size})")
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"the token stream has {tokens.numel()} tokens, fewer than seq_len + 1 = "
                             f"{seq_len + 1} needed for one row")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.tokens = tokens
        self.seed = seed
        self.step = 0
        self._offsets = torch.arange(seq_len + 1, device=tokens.device)

    def batch(self, k: int) -> Tensor:
        """Batch number k (this rank's rows): (batch_size // world_size, seq_len + 1)."""
        g = torch.Generator().manual_seed(batch_seed(self.seed, k))
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (self.batch_size,), generator=g)
        starts = starts[self.rank::self.world_size].to(self.tokens.device)
        return self.tokens[starts[:, None] + self._offsets].long()

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Tensor:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved state: the next batch is batch number state["step"]."""
        missing = {"step", "seed"} - set(state)
        if missing:
            raise ValueError(f"Batches state is missing {sorted(missing)}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Batches state step must be a non-negative integer, got {step!r}")
        self.step, self.seed = step, int(state["seed"])
