"""In-memory trie of n-grams C = {(t, [d_1..d_n])}, n >= 2 (OmniDraft §3.1, eq. (1)).

The decode loop needs three things from the cache and nothing else: longest-match lookup over a
run of drafted tokens (forward translation), the children of a partial match (so the drafter may
propose a sub-token that only makes sense as part of an n-gram), and ``add`` when reverse
translation shows a 1 -> n mapping. ``note_proposed`` / ``note_accepted`` are hooks for a store
that keeps hit counts and recency (LRU/LFU eviction); here they only count.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol


class TrieNode:
    """One node: children by drafter token id, and the target token if a key ends here."""

    __slots__ = ("children", "target")

    def __init__(self) -> None:
        self.children: dict[int, TrieNode] = {}
        self.target: int = -1


class NgramCache(Protocol):
    """What the decode loop needs from an n-gram cache (in memory or persistent).

    ``version`` changes whenever the key set or a target changes, so a consumer that derives
    something from the trie (the drafter's mask of first sub-tokens) can tell it is stale.
    """

    root: TrieNode
    version: int

    def __len__(self) -> int: ...
    def add(self, drafter_ids: Sequence[int], target_id: int) -> bool: ...
    def longest_match(self, ids: Sequence[int], start: int = 0) -> tuple[int, int] | None: ...
    def note_proposed(self, drafter_ids: Sequence[int]) -> None: ...
    def note_accepted(self, drafter_ids: Sequence[int]) -> None: ...
    def flush(self) -> None: ...


class NgramTrie:
    """Drafter-token sequence -> target token id, with longest-prefix matching (in memory)."""

    def __init__(self) -> None:
        self.root = TrieNode()
        self._size = 0
        self.version = 0
        self.hits_proposed = 0
        self.hits_accepted = 0

    def __len__(self) -> int:
        return self._size

    def add(self, drafter_ids: Sequence[int], target_id: int) -> bool:
        """Insert an n-gram (n >= 2); returns True when the key is new."""
        if len(drafter_ids) < 2:
            raise ValueError("an n-gram maps at least 2 drafter tokens to one target token")
        node = self.root
        for tok in drafter_ids:
            node = node.children.setdefault(int(tok), TrieNode())
        is_new = node.target < 0
        if is_new:
            self._size += 1
        if node.target != int(target_id):
            self.version += 1
        node.target = int(target_id)
        return is_new

    def remove(self, drafter_ids: Sequence[int]) -> bool:
        """Delete a key (for eviction); prunes empty branches. Returns True if it existed."""
        path = [self.root]
        for tok in drafter_ids:
            nxt = path[-1].children.get(int(tok))
            if nxt is None:
                return False
            path.append(nxt)
        if path[-1].target < 0:
            return False
        path[-1].target = -1
        self._size -= 1
        self.version += 1
        for depth in range(len(drafter_ids), 0, -1):
            node = path[depth]
            if node.children or node.target >= 0:
                break
            del path[depth - 1].children[int(drafter_ids[depth - 1])]
        return True

    def get(self, drafter_ids: Sequence[int]) -> int | None:
        node = self.root
        for tok in drafter_ids:
            node = node.children.get(int(tok))
            if node is None:
                return None
        return node.target if node.target >= 0 else None

    def longest_match(self, ids: Sequence[int], start: int = 0) -> tuple[int, int] | None:
        """Longest key that is a prefix of ``ids[start:]``: (length, target id), or None."""
        node, best = self.root, None
        for pos in range(start, len(ids)):
            node = node.children.get(ids[pos])
            if node is None:
                break
            if node.target >= 0 and pos - start + 1 >= 2:
                best = (pos - start + 1, node.target)
        return best

    def items(self) -> Iterator[tuple[tuple[int, ...], int]]:
        """All (drafter ids, target id) pairs, depth first."""
        stack: list[tuple[tuple[int, ...], TrieNode]] = [((), self.root)]
        while stack:
            prefix, node = stack.pop()
            if node.target >= 0:
                yield prefix, node.target
            for tok, child in node.children.items():
                stack.append((prefix + (tok,), child))

    def note_proposed(self, drafter_ids: Sequence[int]) -> None:
        """Called when forward translation merged this key into a proposal."""
        self.hits_proposed += 1

    def note_accepted(self, drafter_ids: Sequence[int]) -> None:
        """Called when the target accepted a proposal that came from this key."""
        self.hits_accepted += 1

    def flush(self) -> None:
        """Persist pending changes (no-op in memory; a persistent store writes a batch)."""
