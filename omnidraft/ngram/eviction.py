"""Which n-gram to forget first when the cache is full: LRU or LFU (OmniDraft Table 14).

A lazy heap: every touch pushes the key with its current priority; stale items (the key's
priority changed since, or it was removed) are skipped when popped. The heap is rebuilt when
stale items outnumber live ones, so memory stays within a constant factor of the cache.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Literal

from omnidraft.ngram.files import EntryMeta, Key

Policy = Literal["lru", "lfu"]
POLICIES: tuple[str, ...] = ("lru", "lfu")


def priority(meta: EntryMeta, policy: str) -> tuple[int, ...]:
    """Smallest is evicted first: LRU by last use; LFU by total hits, then last use."""
    if policy == "lfu":
        return (meta.proposed + meta.accepted, meta.last_used)
    return (meta.last_used,)


class EvictionQueue:
    """Priority queue over the live entries of ``entries`` (shared with the store, not copied)."""

    def __init__(self, entries: Mapping[Key, EntryMeta], policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; expected one of {POLICIES}")
        self.entries = entries
        self.policy = policy
        self._heap: list[tuple[tuple[int, ...], Key]] = []

    def touch(self, key: Key, meta: EntryMeta) -> None:
        heapq.heappush(self._heap, (priority(meta, self.policy), key))
        if len(self._heap) > 2 * len(self.entries) + 1024:
            self.rebuild()

    def rebuild(self) -> None:
        self._heap = [(priority(m, self.policy), k) for k, m in self.entries.items()]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()

    def victim(self, exclude: Key | None = None) -> Key | None:
        """The live key to evict next (never ``exclude``), or None; it is popped from the queue."""
        held: list[tuple[tuple[int, ...], Key]] = []
        found = None
        while self._heap:
            prio, key = heapq.heappop(self._heap)
            meta = self.entries.get(key)
            if meta is None or priority(meta, self.policy) != prio:
                continue
            if key == exclude:
                held.append((prio, key))
                continue
            found = key
            break
        for item in held:
            heapq.heappush(self._heap, item)
        return found
