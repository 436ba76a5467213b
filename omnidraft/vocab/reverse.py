"""Reverse translation (Algorithm 1, lines 17-19): keep the drafter's context in step with the target.

Accepted proposals go back as the drafter tokens that produced them (their KV entries stay valid).
A corrected or bonus target token is re-tokenized together with a small look-behind of the
drafter's last tokens — SLEM's heuristic for tokenizers that are not injective — so the drafter
sees a near-canonical tokenization. Whenever that shows one target token covered exactly by n >= 2
drafter tokens, the n-gram is learned.
"""

from __future__ import annotations

from collections.abc import Sequence

from omnidraft.ngram.trie import NgramTrie
from omnidraft.vocab.bridge import VocabBridge

LOOK_BEHIND = 3  # drafter tokens re-tokenized together with a new target token


def drafted_inside(bridge: VocabBridge, drafted: Sequence[int], accepted: bytes) -> tuple[int, int]:
    """(how many leading drafted tokens lie wholly inside ``accepted``, the bytes they cover)."""
    used, kept = 0, 0
    for tok in drafted:
        data = bridge.drafter_bytes(tok)
        if data is None or used + len(data) > len(accepted) or accepted[used:used + len(data)] != data:
            break
        used += len(data)
        kept += 1
    return kept, used


class DrafterContext:
    """The drafter-token context ``ids`` that mirrors the target's emitted text byte for byte."""

    def __init__(self, bridge: VocabBridge, prompt_target_ids: Sequence[int]) -> None:
        self.bridge = bridge
        self.ids: list[int] = bridge.target_to_drafter(prompt_target_ids)
        self.barrier = self._last_special_end(self.ids)  # never look behind a special token

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` drafter ids (a prefix that spells a prefix of the text)."""
        del self.ids[length:]
        self.barrier = self._last_special_end(self.ids)

    def _last_special_end(self, ids: Sequence[int]) -> int:
        for pos in range(len(ids) - 1, -1, -1):
            if self.bridge.drafter_bytes(ids[pos]) is None:
                return pos + 1
        return 0

    def extend_accepted(self, drafted: Sequence[int], end: int) -> None:
        """Append the first ``end`` drafted tokens: the accepted proposals' own sub-tokens."""
        self.ids.extend(drafted[:end])
        for pos in range(len(self.ids) - end, len(self.ids)):
            if self.bridge.drafter_bytes(self.ids[pos]) is None:
                self.barrier = pos + 1

    def extend_accepted_bytes(self, drafted: Sequence[int], accepted: bytes) -> bytes:
        """Keep the drafted tokens that lie wholly inside the accepted text; return the rest of it.

        Used after text-level translation, where target tokens do not map to drafted spans.
        """
        kept, used = drafted_inside(self.bridge, drafted, accepted)
        self.extend_accepted(drafted, kept)
        return accepted[used:]

    def append_target(self, target_id: int, ngrams: NgramTrie | None, before: bytes = b"") -> None:
        """Append one corrected/bonus target token (after ``before``, accepted text the drafter has
        not seen yet); learn an n-gram if it shows a 1 -> n mapping."""
        data = self.bridge.target_bytes(target_id)
        if data is None:  # special token: literal-text partner or nothing
            if before:
                self.append_bytes(before)
            mapped = int(self.bridge.t2d[target_id]) if target_id < len(self.bridge.t2d) else -1
            if mapped >= 0:
                self.ids.append(mapped)
                self.barrier = len(self.ids)
            return
        self.append_bytes(before + data, target_id if ngrams is not None else None, ngrams, len(before))

    def append_text(self, target_ids: Sequence[int]) -> None:
        """Append target tokens the drafter did not draft (plain steps), re-tokenized in one pass per
        run of ordinary tokens: one tokenizer call where one per token would cost a step's worth."""
        run = b""
        for target_id in target_ids:
            data = self.bridge.target_bytes(target_id)
            if data is None:
                self.append_target(target_id, None, before=run)
                run = b""
            else:
                run += data
        if run:
            self.append_bytes(run)

    def append_bytes(self, data: bytes, target_id: int | None = None, ngrams: NgramTrie | None = None,
                     target_start: int = 0) -> None:
        """Append text, re-tokenized with a look-behind; ``data[target_start:]`` is target token
        ``target_id``, learned as an n-gram when drafter tokens cover it exactly."""
        start = self._window_start()
        old = self.ids[start:]
        prefix = b"".join(self.bridge.drafter_bytes(t) for t in old)
        new = self.bridge.drafter_encode(prefix + data)
        self.ids[start:] = new
        if ngrams is not None and target_id is not None and self.bridge.t2d[target_id] < 0:
            self._learn(new, len(prefix) + target_start, len(prefix) + len(data), target_id, ngrams)

    def _window_start(self) -> int:
        """Start of the look-behind: LOOK_BEHIND tokens back, moved to a UTF-8 character start."""
        start = max(self.barrier, len(self.ids) - LOOK_BEHIND)
        while start > self.barrier:
            head = self.bridge.drafter_bytes(self.ids[start])
            if head and (head[0] & 0xC0) != 0x80:  # not a UTF-8 continuation byte
                break
            start -= 1
        return start

    def _learn(self, tokens: list[int], begin: int, end: int, target_id: int, ngrams: NgramTrie) -> None:
        """Add (tokens covering exactly bytes [begin, end)) -> target_id when they are >= 2."""
        offset, first, last = 0, None, None
        for idx, tok in enumerate(tokens):
            if offset == begin:
                first = idx
            offset += len(self.bridge.drafter_bytes(tok) or b"")
            if offset == end:
                last = idx + 1
                break
        if first is not None and last is not None and last - first >= 2:
            ngrams.add(tokens[first:last], target_id)
