"""Drafting from what was already said: prompt lookup in the target's own tokens.

The text being written often repeats the context — code the user pasted and asked to edit, a
document being summarised, an earlier turn. A lookup draft copies the continuation of the longest
earlier occurrence of the last n tokens (n = ``max_n`` down to ``min_n``), like transformers'
``prompt_lookup_num_tokens``, vLLM's ``ngram`` speculator and llama.cpp's lookup decoding. It
costs nothing to draft and needs no vocabulary bridge: it proposes target ids.

:class:`LookupIndex` is incremental: each appended token updates one hash entry per n, so a lookup
is ``max_n`` dictionary probes whatever the context's length (no scan of the context per step).
For every n-gram it keeps where it last ended and where it ended before that, so the suffix that
was just written never matches itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from omnidraft.config import DecodeConfig
from omnidraft.costs import EVEN_PRIOR, Prior
from omnidraft.sources.base import Offer, Parts, StepResult, StepTimes, lookup_applies
from omnidraft.verify.proposal import Proposal
from omnidraft.vocab.token_bytes import special_ids

if TYPE_CHECKING:
    from omnidraft.sources.policy import SourcePolicy

LOOKUP_MAX = 16  # most tokens a lookup draft copies (it costs nothing to draft; the policy cuts it)
LONG_MATCH = 8  # a match of this many tokens or more: the text is being copied
LONG_MATCH_PRIOR = Prior(0.9, 8.0)  # a long match's key before evidence (docs/lookup.md: 0.9-1.0 on code)


def match_key(source: str, n: int) -> str:
    """The policy's acceptance key of a lookup draft from a match of n tokens. Matches of 4-7
    tokens share one key (their acceptance is alike, and fewer keys learn faster); a long match
    (``LONG_MATCH`` or more) has its own, which starts from ``LONG_MATCH_PRIOR``."""
    return f"{source}-{n if n < 4 else 4 if n < LONG_MATCH else LONG_MATCH}"


def match_prior(n: int) -> Prior:
    """Where a lookup key's acceptance starts: a long match is a copy, right nine times in ten over
    hundreds of matches measured, so it may draft from its first step even where a verify costs
    several steps (llama.cpp on a CPU), which an even prior never allows, and one unlucky draft does
    not turn it off; shorter matches start even."""
    return LONG_MATCH_PRIOR if n >= LONG_MATCH else EVEN_PRIOR


class LookupIndex:
    """n-gram -> latest end positions in a growing token list (see the module docstring)."""

    def __init__(self, max_n: int = 4, min_n: int = 2, stops: frozenset[int] = frozenset()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("lookup needs 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n
        # a copy ends before any of these (special tokens): a reply that repeats the user's words runs into
        # the chat template's markers in the prompt, which the target does not write there
        self.stops = stops
        self.ids: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        self._before: dict[tuple[int, ...], int] = {}

    def reset(self, ids: Sequence[int] = ()) -> None:
        self.ids, self._last, self._before = [], {}, {}
        self.extend(ids)

    def sync(self, ids: Sequence[int]) -> None:
        """Follow ``ids``: extend when it extends what is indexed, else index it afresh."""
        n = len(self.ids)
        if len(ids) >= n and list(ids[:n]) == self.ids:
            self.extend(ids[n:])
        else:
            self.reset(ids)

    def extend(self, tokens: Sequence[int]) -> None:
        ids = self.ids
        for tok in tokens:
            ids.append(int(tok))
            end = len(ids)
            for n in range(1, min(self.max_n, end) + 1):
                key = tuple(ids[end - n:])
                last = self._last.get(key)
                if last is not None:
                    self._before[key] = last
                self._last[key] = end

    def propose(self, k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the longest earlier match of the current suffix, up to the first
        stop token, and the match's length n); ([], 0) without a match of at least ``min_n`` tokens."""
        ids, end = self.ids, len(self.ids)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            key = tuple(ids[end - n:])
            pos = self._last.get(key)
            if pos == end:
                pos = self._before.get(key)
            if pos is not None and pos < end:
                copied = ids[pos: pos + k]
                cut = next((j for j, tok in enumerate(copied) if tok in self.stops), len(copied))
                if cut:
                    return copied[:cut], n
        return [], 0


class ContextLookup:
    """The draft source over the current context: its index follows every emitted token."""

    name, free = "context", True

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.index = LookupIndex(max_n=LONG_MATCH, stops=special_ids(parts.target.tokenizer))

    @classmethod
    def build(cls, parts: Parts) -> ContextLookup | None:
        return cls(parts) if parts.lookup else None

    def begin(self, ids: list[int], config: DecodeConfig, policy: SourcePolicy) -> bool:
        if not lookup_applies(self.parts, config):
            return False
        self.index.sync(ids)  # indexed once per request (the prompt), then extended by each step's tokens
        return True

    def offer(self, ids: list[int], room: int) -> Offer | None:
        copied, matched = self.index.propose(min(LOOKUP_MAX, room))
        if not copied:
            return None
        return Offer(match_key(self.name, matched), len(copied), copied, prior=match_prior(matched))

    def draft(self, ids: list[int], offer: Offer, k: int, times: StepTimes) -> Proposal:
        return Proposal(offer.ids[:k])

    def accept(self, step: StepResult) -> None:
        self.index.extend(step.emitted)

    def finish(self, prompt_len: int, ids: list[int]) -> None:
        pass
