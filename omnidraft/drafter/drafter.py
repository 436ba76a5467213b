"""The drafter: proposes up to k drafter tokens from its own KV cache (Algorithm 1, lines 5-7).

What may be proposed is the translator's constraint (direct-mapped tokens and n-gram sub-tokens
for token translation, anything with bytes for text translation); how a token is picked and when
the draft ends is the policy's (``policy.py``). The model under it is a :class:`DraftLM` backend.

The drafter's context window is its own, smaller than most targets': past it, the drafter reads
the first SINK tokens and the most recent part of the conversation (a window that slides in steps
of a quarter window). A backend that can drop cached positions (``DraftLM.drop``: the native and
llama.cpp drafters) keeps what the window still covers, re-rotated, as llama.cpp's context shift and
StreamingLLM (whose attention sinks the first tokens are) do; its window is also capped at
DRAFT_WINDOW, because a drafted token's attention grows with the context while the drafter's use of
a far context is small. Other backends read the window again once per quarter window.

One catch-up read is capped at CATCH_UP_CAP tokens where the cache already holds at least that
much of the text (a chat's next message, the text after a run of plain steps): the window then
starts CATCH_UP_CAP tokens before the end, and what the cache held is dropped. Reading a long new
message behind a long conversation costs more per token than reading it alone (each read token
attends to the whole cache), and the drafted tokens after it pay for the longer window too; the
far context is what the drafter uses least. A first read (a fresh prompt, nothing cached) is never
capped: code needs its prompt.

A text rewritten before the cached part (a chat that dropped its oldest turns to fit the target's
context) is found again: where the cache's last tokens occur in the new text, the window moves to
the start of what the cache still matches there, and a backend that can drop positions drops the
cached ones the new text no longer has. Only the new message is read, not the whole window again.
Where the cached text and the new one differ at a seam (the same characters tokenized otherwise
when the conversation was rendered again), the search goes on before the seam, and the read starts
at the seam.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from omnidraft.adapter.head import AcceptHead
from omnidraft.drafter.base import Draft, DraftLM
from omnidraft.drafter.policy import DraftPolicy
from omnidraft.kv import common_prefix_len

WINDOW_MARGIN = 16  # positions kept free beyond the draft itself
DRAFT_ROOM = 64  # the draft lengths a window leaves room for: below it, the window does not depend on k
SINK = 4  # first tokens every window keeps (StreamingLLM's attention sinks)
DRAFT_WINDOW = 1024  # the window of a drafter that can drop positions (a token's attention cost grows with it)
CATCH_UP_CAP = 256  # the most one catch-up reads behind a cache that holds at least this much of the text
RELOCATE_MIN = 64  # cached tokens past the sinks that a rewritten text must still hold for the cache to be kept
RELOCATE_PROBE = 16  # cached tokens searched for in a rewritten text
RELOCATE_BACK = 32  # ... ending up to this far before the cache's end (drafted tokens the target rejected)
RELOCATE_SEAMS = 4  # seams (text tokenized otherwise than in the cache) the search steps back past


class Drafter:
    """Autoregressive drafting over a :class:`DraftLM` (torch or onnxruntime)."""

    def __init__(self, lm: DraftLM, stop_ids: Sequence[int] = ()) -> None:
        self.lm = lm
        self.stop_ids = {int(t) for t in stop_ids}  # drafter ids after which drafting is pointless
        self.head: AcceptHead | None = None  # set by the adapter slot with the adapter's head
        self._start = SINK  # where the window's part after the sinks began in the context last read
        self._floor = SINK  # where a capped catch-up moved the window's start (SINK: no cap in force)

    def reset(self) -> None:
        self.lm.reset()
        self._floor = SINK

    def window(self, context: Sequence[int], k: int) -> Sequence[int]:
        """What of ``context`` the drafter reads before drafting up to ``k`` tokens: all of it, or past
        its limit the first SINK tokens and a recent part that slides a quarter window at a time."""
        return _from(context, self._body_start(len(context), k))

    def window_size(self, length: int, k: int) -> int:
        """How many tokens ``window`` keeps of a context of ``length`` (no copy: the offers ask each step)."""
        start = self._body_start(length, k)
        return length if start == SINK else SINK + length - start

    def unread(self, length: int, k: int) -> int:
        """How many tokens a draft of ``k`` on a context of ``length`` would read first, assuming its
        cache holds the window's prefix (an estimate for the offers: ``_window`` decides)."""
        cached = len(self.lm.cached_ids)
        unread = max(self.window_size(length, k) - cached, 0)
        return min(unread, CATCH_UP_CAP) if cached - SINK >= CATCH_UP_CAP else unread

    def _body_start(self, length: int, k: int) -> int:
        """Where in a context of ``length`` tokens the window's part after the sinks begins."""
        limit = min(self.lm.max_positions, DRAFT_WINDOW) if hasattr(self.lm, "drop") else self.lm.max_positions
        # the same window for every draft length up to DRAFT_ROOM: one that moved with k (the cost policy
        # picks k per step) slid back and forth, and each draft read hundreds of tokens again
        size = limit - max(k, DRAFT_ROOM) - WINDOW_MARGIN
        floor = self._floor if self._floor < length else SINK
        if length <= size:
            return floor
        step = max((size - SINK) // 4, 1)
        return max(SINK + ((length - size) // step + 1) * step, floor)

    def _window(self, context: Sequence[int], k: int, cap: bool = True) -> Sequence[int]:
        """The window to read now; where it slid past what the cache holds, a backend that can drop
        positions drops the ones left behind (checked against the cache: the text may have changed),
        so that only the new tokens are read. With ``cap``, a long catch-up is capped (module doc)."""
        held = self._held(context)  # before a drop moves the cache to the new start
        past_sinks = len(self.lm.cached_ids) - SINK
        if past_sinks - held >= RELOCATE_MIN:  # much of the cache is not where the text is now: rewritten?
            held = self._relocate(context) or held
        if self._floor != SINK and (past_sinks <= 0 or held < min(past_sinks, 8)):
            self._floor = SINK  # the cache no longer holds the capped window: a new text, a dropped cache
        start = self._body_start(len(context), k)
        window = _from(context, start)
        shift, cached = start - self._start, self.lm.cached_ids
        if hasattr(self.lm, "drop") and shift > 0 and len(cached) >= SINK + shift + 8 and len(window) >= SINK + 8:
            if cached[:SINK] == list(window[:SINK]) and cached[SINK + shift:SINK + shift + 8] == list(window[SINK:SINK + 8]):
                self.lm.drop(SINK, shift)
        if cap and held >= CATCH_UP_CAP:
            unread = len(window) - common_prefix_len(self.lm.cached_ids, window)
            if unread > CATCH_UP_CAP:
                self._floor = start = len(context) - CATCH_UP_CAP
                window = _from(context, start)
        self._start = start
        return window

    def _held(self, context: Sequence[int]) -> int:
        """How many tokens of ``context`` past the sinks the cache holds, from where the last window
        began: also where the new text is longer than the window, so nothing of it is in the cache."""
        cached = self.lm.cached_ids
        if len(cached) <= SINK or cached[:SINK] != list(context[:SINK]):
            return 0
        return common_prefix_len(cached[SINK:], context[self._start:self._start + len(cached) - SINK])

    def _relocate(self, context: Sequence[int]) -> int:
        """Where the text before the cached part was rewritten (module doc): find RELOCATE_PROBE cached
        tokens from the cache's end in ``context`` (their last occurrence; the probe steps back past
        drafted tokens the target rejected, which the new text does not have) and extend the match
        backwards; a match cut short by a seam is searched for again before the seam (up to
        RELOCATE_SEAMS times). If at least RELOCATE_MIN cached tokens match, drop the cached ones
        before the match that the new text no longer has: all of them past the sinks, or, where the match begins right
        after the text both still start with (a chat's system prompt), those between the two. Returns
        how many cached tokens of the text the window then starts with (0: none)."""
        cached = self.lm.cached_ids
        if len(cached) - SINK < RELOCATE_MIN or list(context[:SINK]) != cached[:SINK]:
            return 0
        last = len(cached)  # the search ends here: the cache's end, then the cached token at a seam
        for _ in range(RELOCATE_SEAMS + 1):
            found = _find_probe(cached, context, last)
            if found is None:
                return 0
            last, end = found  # cached[last - PROBE:last] == context[end - PROBE:end]
            matched = RELOCATE_PROBE
            while matched < last - SINK and end - matched > SINK and cached[last - matched - 1] == context[end - matched - 1]:
                matched += 1
            if matched >= RELOCATE_MIN:
                break
            last -= matched + 1  # a seam (or text the new one lacks): go on before it
        else:
            return 0
        begin, head = end - matched, common_prefix_len(cached, context)
        keep = head if begin == head else SINK  # cached positions kept before the match
        gone = last - matched - keep
        if gone and not hasattr(self.lm, "drop"):
            return 0
        if gone:
            self.lm.drop(keep, gone)
        self._start = self._floor = SINK if begin == head else begin
        return end - self._start

    @torch.inference_mode()
    def read(self, context: Sequence[int], k: int, limit: int, cap: bool = True) -> int:
        """Read up to ``limit`` tokens of what ``draft(context, k)`` would read first, and say how many
        it would still read beyond ``limit`` (0: the draft's own read is at most ``limit``, left to it).
        A long prompt's read then comes in pieces that whoever drafts can stop between. ``cap=False``:
        a read in idle time (the chat's while the user types) keeps the whole window."""
        window = self._window(context, k, cap)
        cached = common_prefix_len(self.lm.cached_ids, window)
        left = len(window) - cached - limit
        if left <= 0:
            return 0
        self.lm.logits_for(window[: cached + limit])
        return left

    @torch.inference_mode()
    def draft(self, context: Sequence[int], k: int, policy: DraftPolicy, first: torch.Tensor | None = None) -> Draft:
        """Draft up to ``k`` tokens after ``context`` (drafter ids) under ``policy``; ``first``: a bias
        added for the first token only (token healing's constraint: ``vocab/healing.py``)."""
        return self.draft_after(self._window(context, k), k, policy, first)

    @torch.inference_mode()
    def draft_after(self, window: Sequence[int], k: int, policy: DraftPolicy, first: torch.Tensor | None = None) -> Draft:
        """Draft up to ``k`` tokens after exactly ``window`` (a window ``draft`` chose, perhaps grown
        by drafted tokens: a fork off the line), leaving the window's state as it was."""
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        runners_up: list[int] = []
        policy.constraint.start()
        policy.stop.start()
        read_tokens = len(window) - common_prefix_len(self.lm.cached_ids, window)
        start = time.perf_counter()
        logits = self.lm.logits_for(window)
        read_s = time.perf_counter() - start
        for step in range(k):
            masked = logits + policy.constraint.bias()
            if step == 0 and first is not None:
                masked = masked + first
            token, q = policy.sampler.choose(masked)
            if policy.runners_up:
                runners_up.append(runner_up(masked, token))
            stop = policy.stop.stop_after(token, masked, q, self.lm.last_hidden, logits)
            tokens.append(token)
            if q is not None:
                qs.append(q)
            policy.constraint.advance(token)
            feed = policy.sampler.feed(token)
            if stop or not feed or any(d in self.stop_ids for d in feed) or step == k - 1:
                break
            for d in feed:
                logits = self.lm.step(d)
        return Draft(tokens, torch.stack(qs) if qs else None, window, k, read_s, read_tokens, runners_up)


def _from(context: Sequence[int], start: int) -> Sequence[int]:
    """The window whose part after the sinks begins at ``start`` (SINK: all of the context)."""
    return context if start == SINK else list(context[:SINK]) + list(context[start:])


def _find_probe(cached: Sequence[int], context: Sequence[int], last: int) -> tuple[int, int] | None:
    """The RELOCATE_PROBE cached tokens ending at ``last``, or (stepping back past tokens the new text
    lacks: rejected drafted ones, a seam) ending up to RELOCATE_BACK before it, that occur in
    ``context`` past the sinks: (where they end in the cache, where in the context), or None."""
    for back in range(0, RELOCATE_BACK + 1, RELOCATE_PROBE):
        end_cached = last - back
        if end_cached - RELOCATE_PROBE < SINK:
            return None
        end = _last_occurrence(context, cached[end_cached - RELOCATE_PROBE:end_cached], SINK)
        if end >= 0:
            return end_cached, end
    return None


def _last_occurrence(seq: Sequence[int], probe: Sequence[int], lo: int = 0) -> int:
    """The index just past the last occurrence of ``probe`` in ``seq`` at or after ``lo`` (-1: none)."""
    probe = list(probe)
    first, width = probe[0], len(probe)
    for i in range(len(seq) - width, lo - 1, -1):
        if seq[i] == first and list(seq[i:i + width]) == probe:
            return i + width
    return -1


def runner_up(masked: torch.Tensor, chosen: int) -> int:
    """The most likely allowed token other than ``chosen`` (-1: none is allowed). One argmax with
    ``chosen`` hidden, on numpy: an order of magnitude cheaper than torch's topk on a CPU row."""
    row = masked.detach().numpy() if masked.device.type == "cpu" and masked.dtype == torch.float32 else masked.float().cpu().numpy()
    kept = row[chosen]
    row[chosen] = -np.inf
    other = int(row.argmax())
    allowed = np.isfinite(row[other])
    row[chosen] = kept
    return other if allowed else -1
