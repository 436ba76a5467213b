"""Token trees: a chain of proposals plus branches, and the greedy walk that verifies them.

A *branch* is another way the chain could go from one of its positions: at ``depth`` d it replaces
the proposals from d on by its own ``tokens``, so its path is ``proposed[:d] + tokens``. The model
drafter offers its runner-up token at each drafted position this way (SpecInfer's token tree, Miao
et al. 2024, §3, reduced to one chain and leaves a few tokens deep): when the target rejects a
proposal, it often wants the drafter's second choice there, and one forward scores the chain and
every branch, each row attending to its own path only (``kv.tree_mask``).

Greedy only: the walk follows the target's argmax through the tree, so what it emits is the
target's own greedy decode whatever the tree holds. The sampling rules verify chains.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Branch:
    """Tokens that replace the chain's proposals from index ``depth`` on (0 <= depth <= len(proposed);
    at len(proposed) it continues the whole chain)."""

    depth: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Walk:
    """Where the greedy walk ended: the proposals it kept (the chain's, then a branch's), the
    target's next token, and the row of the scored tree before each emitted token."""

    path: list[int]
    next_token: int
    rows: list[int]
    branch_kept: int = 0  # the path's tokens from a branch (at its end)


def check_branches(branches: Sequence[Branch], proposed: int) -> None:
    """Branches a tree read can hold: non-empty, hanging off the chain (depth <= proposed)."""
    for b in branches:
        if not b.tokens or not 0 <= b.depth <= proposed:
            raise ValueError(f"a branch needs tokens and a depth in [0, {proposed}], got {b}")


def walk(choices: Sequence[int], proposed: Sequence[int], branches: Sequence[Branch]) -> Walk:
    """The greedy walk over a scored tree. ``choices`` is the target's argmax of each row: the chain's
    ``len(proposed) + 1`` rows (row i predicts the token after ``proposed[:i]``), then each branch's
    rows in order (row j of a branch predicts the token after its first j + 1 tokens).

    Follow the chain while the target agrees; where it first disagrees (depth i, wanting t), take a
    branch at depth i that starts with t, if any, and follow it while the target agrees."""
    k = len(proposed)
    i = 0
    while i < k and choices[i] == proposed[i]:
        i += 1
    want, rows = choices[i], list(range(i + 1))
    offset = k + 1
    for b in branches:
        if b.depth == i and b.tokens[0] == want:
            m = 1
            while m < len(b.tokens) and choices[offset + m - 1] == b.tokens[m]:
                m += 1
            rows += range(offset, offset + m)
            return Walk(list(proposed[:i]) + list(b.tokens[:m]), choices[offset + m - 1], rows, m)
        offset += len(b.tokens)
    return Walk(list(proposed[:i]), want, rows)


def fit_branches(branches: Sequence[Branch], proposed: int, room: int) -> list[Branch]:
    """The branches that still hang off a chain cut to ``proposed`` tokens, each cut so that its path
    stays within ``room`` proposals (the tokens the request may still emit before the target's own)."""
    out = []
    for b in branches:
        fit = b.tokens[: room - b.depth]
        if b.depth <= proposed and fit:
            out.append(Branch(b.depth, fit))
    return out


def rows_of(branches: Sequence[Branch]) -> int:
    """Rows the branches add to a verify."""
    return sum(len(b.tokens) for b in branches)
