"""Token healing: the drafter drafts its context's last token again when that token is whitespace.

The drafter's context is the target's text re-tokenized with the drafter's tokenizer, so it ends
wherever the target's last token ended. The two tokenizers cut whitespace differently: SmolLM2 spells a
line break and the next line's indent as one token ("\\n" + 8 spaces) where Qwen emits "):\\n" and then
the indent. After a step that ends on "):\\n" the drafter's context ends in a bare "\\n" token, a
spelling its own tokenizer never makes before an indented line, and the drafter guesses badly what
follows (after a docstring's closing line it proposed "#" or "```" where the target indents).

Token healing (as guidance does for prompts) backs the context off by that token and constrains the
first drafted token to begin with its bytes: the drafter then spells the boundary as its tokenizer
would, and the translator drops those bytes again from the drafted text (they are the target's
already). Only whitespace tokens are healed: healing any token that others extend (" the" ->
" there") lowered acceptance on prose, where a word the target ended is a word, not a prefix
(docs/performance.md has both measurements).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch


class TokenHealing:
    """Which last tokens of a drafter context to draft again, and the first-token bias for it."""

    def __init__(self, token_bytes: Sequence[bytes | None], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        entries = sorted((data, idx) for idx, data in enumerate(token_bytes[:vocab_size]) if data)
        self._keys = [data for data, _ in entries]
        self._ids = [idx for _, idx in entries]
        self._token_bytes = token_bytes
        self._bias: dict[int, torch.Tensor | None] = {}

    def heal(self, last: int) -> tuple[bytes, torch.Tensor] | None:
        """For a context ending in drafter token ``last``: its bytes, which the draft spells again, and
        the first drafted token's bias, 0 on the tokens that begin with those bytes (``last`` itself
        included) and -inf elsewhere. None where ``last`` is not healed: not whitespace, or no longer
        token begins with it."""
        if last not in self._bias:
            self._bias[last] = self._make_bias(last)
        bias = self._bias[last]
        return (self._token_bytes[last], bias) if bias is not None else None

    def _make_bias(self, last: int) -> torch.Tensor | None:
        data = self._token_bytes[last] if 0 <= last < len(self._token_bytes) else None
        if not data or data.strip() or last >= self.vocab_size:
            return None
        lo = bisect.bisect_left(self._keys, data)
        hi = lo
        while hi < len(self._keys) and self._keys[hi].startswith(data):
            hi += 1
        if hi - lo < 2:  # only the token itself: nothing to heal into
            return None
        bias = torch.full((self.vocab_size,), float("-inf"))
        bias[torch.tensor(self._ids[lo:hi], dtype=torch.long)] = 0.0
        return bias
