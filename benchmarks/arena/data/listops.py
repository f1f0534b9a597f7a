"""ListOps (Nangia & Bowman 2018) with the grammar and constants of the Long Range Arena generator
(Tay et al. 2020, arXiv:2011.04006): nested MAX, MIN, MED and SM (sum modulo 10) over digits 0-9.

Surface form: "[MAX 2 9 [MIN 4 7 ] 0 ]". The LRA files also wrap every operator application in
binary "( ... )" pairs, but the LRA length bounds count tokens without them and common LRA loaders
strip them, so they are left out here: a sequence's token count is the length that was bounded.
"""

from __future__ import annotations

import torch

OPERATORS: tuple[str, ...] = ("MAX", "MIN", "MED", "SM")
CLOSE = "]"
DIGITS: tuple[str, ...] = tuple(str(d) for d in range(10))
OPENERS: tuple[str, ...] = tuple("[" + op for op in OPERATORS)
VOCAB: list[str] = ["<pad>", *DIGITS, *OPENERS, CLOSE]
NUM_CLASSES = 10

# LRA draws r ~ U[0, 1) per node and makes it a leaf when r > 0.25 (VALUE_P), so a node below the
# depth cap is an operator with probability 0.25; the root is at depth 1 and depth max_depth is
# always a leaf, so at most max_depth - 1 operators are ever nested.
_OP_PROB = 0.25
# A cap on rejection: below one accepted tree per this many draws the window is treated as
# unreachable in practice rather than looping for minutes.
_MAX_TRIALS_PER_EXAMPLE = 100_000
_BATCH = 8192                                           # trees drawn at once; fixed for determinism

_INDEX = {token: i for i, token in enumerate(VOCAB)}
_OPENER_OP = {opener: op for opener, op in zip(OPENERS, OPERATORS)}


def _median(args: list[int]) -> int:
    # LRA takes int(np.median(args)): the mean of the two middle values, truncated, for an even count.
    s = sorted(args)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) // 2


def _apply(op: str, args: list[int]) -> int:
    if not args:
        raise ValueError(f"args: expected at least one argument for {op}")
    if op == "MAX":
        return max(args)
    if op == "MIN":
        return min(args)
    if op == "MED":
        return _median(args)
    if op == "SM":
        return sum(args) % 10
    raise ValueError(f"op: expected one of {OPERATORS}, got {op!r}")


def _longest(max_depth: int, max_args: int) -> int:
    length = 1
    for _ in range(max_depth - 1):
        length = 2 + max_args * length
    return length


def _draw_batch(g: torch.Generator, min_len: int, max_len: int, max_depth: int, max_args: int
                ) -> list[list[tuple[list[int], list[int]]]]:
    """Draw _BATCH trees from the grammar breadth first, all at once, and return those whose length
    lies in [min_len, max_len], in draw order: per tree and level from the root, the arity of
    each node (0 for a leaf) and its symbol (a digit for a leaf, an OPERATORS index otherwise).
    A node's children are the next consecutive nodes of the level below."""
    owner = torch.arange(_BATCH)                       # the tree each node of this level belongs to
    length = torch.zeros(_BATCH, dtype=torch.int64)
    alive = torch.ones(_BATCH, dtype=torch.bool)
    levels: list[tuple[torch.Tensor, torch.Tensor]] = []
    for depth in range(1, max_depth + 1):
        u = torch.rand(owner.numel(), generator=g)
        is_op = u < _OP_PROB if depth < max_depth else torch.zeros_like(u, dtype=torch.bool)
        # Below _OP_PROB, u / _OP_PROB is again uniform on [0, 1): it picks the argument count.
        arity = torch.where(is_op, 2 + (u / _OP_PROB * (max_args - 1)).long().clamp(max=max_args - 2), 0)
        levels.append((owner, arity))
        length.index_add_(0, owner, 1 + is_op.long())  # a node's token, and "]" for an operator
        width = torch.zeros(_BATCH, dtype=torch.int64).index_add_(0, owner, arity)
        # A tree whose next level alone would push it past max_len is dropped before that level
        # is drawn; otherwise rejection spends nearly all its time growing doomed trees.
        alive &= length + width <= max_len
        growing = alive[owner] & is_op
        if not growing.any():
            break
        owner = torch.repeat_interleave(owner[growing], arity[growing])
    kept = alive & (length >= min_len)
    trees: list[list[tuple[list[int], list[int]]]] = [[] for _ in range(int(kept.sum()))]
    for owner, arity in levels:
        mine = kept[owner]
        counts = torch.bincount(owner[mine], minlength=_BATCH)[kept].tolist()
        arity = arity[mine]
        # Symbols only for the kept trees: a digit for a leaf, an OPERATORS index otherwise.
        symbol = (torch.rand(arity.numel(), generator=g) * torch.where(arity > 0, len(OPERATORS), 10))
        arities, symbols = arity.tolist(), symbol.long().clamp(max=9).tolist()
        start = 0
        for tree, count in zip(trees, counts):
            if count:
                tree.append((arities[start:start + count], symbols[start:start + count]))
            start += count
    return trees


def _fill(levels: list[tuple[list[int], list[int]]]) -> tuple[list[str], int]:
    """Tokens and value of a tree drawn by _draw_batch, built from its deepest level up."""
    below: list[tuple[list[str], int]] = []
    for arities, symbols in reversed(levels):
        here: list[tuple[list[str], int]] = []
        child = 0
        for arity, symbol in zip(arities, symbols):
            if arity == 0:
                here.append(([DIGITS[symbol]], symbol))
                continue
            tokens = [OPENERS[symbol]]
            args = []
            for sub_tokens, value in below[child:child + arity]:
                tokens += sub_tokens
                args.append(value)
            tokens.append(CLOSE)
            child += arity
            here.append((tokens, _apply(OPERATORS[symbol], args)))
        below = here
    return below[0]


def generate(num: int, seed: int, *, min_len: int = 500, max_len: int = 2000, max_depth: int = 10,
             max_args: int = 10) -> list[tuple[list[str], int]]:
    """`num` (tokens, answer) examples with min_len <= len(tokens) <= max_len (inclusive; LRA's own
    bounds are strict), drawn from `seed` alone by rejection as in LRA: a tree is drawn from the
    grammar and kept only if its length falls in the window, so kept trees follow the grammar's
    distribution conditioned on length. Trees are drawn in fixed batches, so a smaller `num`
    gives a prefix of a larger one. Repeats are not removed (LRA dedups its pool); at LRA lengths
    they practically never occur.

    Lengths 2 and 3 and lengths beyond the full tree cannot occur: a window holding none of the
    others raises ValueError, as does one the grammar reaches less than once per
    _MAX_TRIALS_PER_EXAMPLE trees. A narrow window is slower but exact: [500, 512] keeps about one
    tree in 600.
    """
    for name, value, least in (("num", num, 0), ("min_len", min_len, 1), ("max_depth", max_depth, 1),
                               ("max_args", max_args, 2)):
        if value < least:
            raise ValueError(f"{name}: expected an integer >= {least}, got {value}")
    if max_len < min_len:
        raise ValueError(f"max_len: expected >= min_len ({min_len}), got {max_len}")
    longest = _longest(max_depth, max_args)
    if (max_len < 4 and min_len > 1) or min_len > longest:
        raise ValueError(f"min_len/max_len: no tree has a length in [{min_len}, {max_len}] "
                         f"(possible: 1 and 4..{longest} for max_depth {max_depth}, max_args {max_args})")
    g = torch.Generator().manual_seed(seed)
    examples: list[tuple[list[str], int]] = []
    trials = 0
    while len(examples) < num:
        if trials >= _MAX_TRIALS_PER_EXAMPLE * (len(examples) + 1):
            raise ValueError(f"min_len/max_len: fewer than 1 in {_MAX_TRIALS_PER_EXAMPLE} trees has a "
                             f"length in [{min_len}, {max_len}]; widen the window")
        trials += _BATCH
        for levels in _draw_batch(g, min_len, max_len, max_depth, max_args)[:num - len(examples)]:
            examples.append(_fill(levels))
    return examples


def evaluate(tokens: list[str]) -> int:
    """The value of a token sequence, parsed directly (a stack of open operators), not through the
    generator's tree. Raises ValueError unless it is exactly one well-formed expression."""
    stack: list[tuple[str, list[int]]] = []
    result: int | None = None
    for position, token in enumerate(tokens):
        if result is not None:
            raise ValueError(f"tokens: expected the end after a complete expression, got {token!r} "
                             f"at {position}")
        if token in _OPENER_OP:
            stack.append((_OPENER_OP[token], []))
            continue
        if token == CLOSE:
            if not stack:
                raise ValueError(f"tokens: unmatched {CLOSE!r} at {position}")
            op, args = stack.pop()
            if not args:
                raise ValueError(f"tokens: {op} closed without arguments at {position}")
            value = _apply(op, args)
        elif token in DIGITS:
            value = int(token)
        else:
            raise ValueError(f"tokens: expected a digit, an operator or {CLOSE!r}, got {token!r} "
                             f"at {position}")
        if stack:
            stack[-1][1].append(value)
        else:
            result = value
    if stack:
        raise ValueError(f"tokens: {len(stack)} operator(s) left open at the end")
    if result is None:
        raise ValueError("tokens: expected an expression, got none")
    return result


def encode(tokens: list[str]) -> list[int]:
    """Vocabulary ids of `tokens` (VOCAB index; 0 is padding and never produced)."""
    try:
        return [_INDEX[token] for token in tokens]
    except KeyError as error:
        raise ValueError(f"tokens: {error.args[0]!r} is not in VOCAB") from None


def batch(examples: list[tuple[list[str], int]], length: int | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, labels): ids (N, L) int64 right-padded with 0, mask (N, L) True on real tokens,
    labels (N,) int64; L is the longest example unless `length` is given."""
    longest = max((len(tokens) for tokens, _ in examples), default=0)
    if length is None:
        length = longest
    elif length < longest:
        raise ValueError(f"length: expected >= the longest example ({longest} tokens), got {length}")
    ids = torch.zeros(len(examples), length, dtype=torch.int64)
    mask = torch.zeros(len(examples), length, dtype=torch.bool)
    labels = torch.empty(len(examples), dtype=torch.int64)
    for row, (tokens, label) in enumerate(examples):
        if not 0 <= label < NUM_CLASSES:
            raise ValueError(f"examples: expected labels in [0, {NUM_CLASSES}), got {label} at {row}")
        ids[row, :len(tokens)] = torch.tensor(encode(tokens), dtype=torch.int64)
        mask[row, :len(tokens)] = True
        labels[row] = label
    return ids, mask, labels
