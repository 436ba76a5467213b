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


class Drafter:
    """Autoregressive drafting over a :class:`DraftLM` (torch or onnxruntime)."""

    def __init__(self, lm: DraftLM, stop_ids: Sequence[int] = ()) -> None:
        self.lm = lm
        self.stop_ids = {int(t) for t in stop_ids}  # drafter ids after which drafting is pointless
        self.head: AcceptHead | None = None  # set by the adapter slot with the adapter's head
        self._start = SINK  # where the window's part after the sinks began in the context last read

    def reset(self) -> None:
        self.lm.reset()

    def window(self, context: Sequence[int], k: int) -> Sequence[int]:
        """What of ``context`` the drafter reads before drafting up to ``k`` tokens: all of it, or past
        its limit the first SINK tokens and a recent part that slides a quarter window at a time."""
        return _from(context, self._body_start(len(context), k))

    def window_size(self, length: int, k: int) -> int:
        """How many tokens ``window`` keeps of a context of ``length`` (no copy: the offers ask each step)."""
        start = self._body_start(length, k)
        return length if start == SINK else SINK + length - start

    def _body_start(self, length: int, k: int) -> int:
        """Where in a context of ``length`` tokens the window's part after the sinks begins."""
        limit = min(self.lm.max_positions, DRAFT_WINDOW) if hasattr(self.lm, "drop") else self.lm.max_positions
        # the same window for every draft length up to DRAFT_ROOM: one that moved with k (the cost policy
        # picks k per step) slid back and forth, and each draft read hundreds of tokens again
        size = limit - max(k, DRAFT_ROOM) - WINDOW_MARGIN
        if length <= size:
            return SINK
        step = max((size - SINK) // 4, 1)
        return SINK + ((length - size) // step + 1) * step

    def _window(self, context: Sequence[int], k: int) -> Sequence[int]:
        """The window to read now; where it slid past what the cache holds, a backend that can drop
        positions drops the ones left behind (checked against the cache: the text may have changed),
        so that only the new tokens are read."""
        start = self._body_start(len(context), k)
        window = _from(context, start)
        shift, cached = start - self._start, self.lm.cached_ids
        if hasattr(self.lm, "drop") and shift > 0 and len(cached) >= SINK + shift + 8 and len(window) >= SINK + 8:
            if cached[:SINK] == list(window[:SINK]) and cached[SINK + shift:SINK + shift + 8] == list(window[SINK:SINK + 8]):
                self.lm.drop(SINK, shift)
        self._start = start
        return window

    @torch.inference_mode()
    def read(self, context: Sequence[int], k: int, limit: int) -> int:
        """Read up to ``limit`` tokens of what ``draft(context, k)`` would read first, and say how many
        it would still read beyond ``limit`` (0: the draft's own read is at most ``limit``, left to it).
        A long prompt's read then comes in pieces that whoever drafts can stop between."""
        window = self._window(context, k)
        cached = common_prefix_len(self.lm.cached_ids, window)
        left = len(window) - cached - limit
        if left <= 0:
            return 0
        self.lm.logits_for(window[: cached + limit])
        return left

    @torch.inference_mode()
    def draft(self, context: Sequence[int], k: int, policy: DraftPolicy) -> Draft:
        """Draft up to ``k`` tokens after ``context`` (drafter ids) under ``policy``."""
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        runners_up: list[int] = []
        policy.constraint.start()
        policy.stop.start()
        window = self._window(context, k)
        read_tokens = len(window) - common_prefix_len(self.lm.cached_ids, window)
        start = time.perf_counter()
        logits = self.lm.logits_for(window)
        read_s = time.perf_counter() - start
        for step in range(k):
            masked = logits + policy.constraint.bias()
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
