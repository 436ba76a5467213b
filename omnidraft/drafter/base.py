"""What a drafter hands to the loop, and what a drafter backend must provide.

The drafting algorithm (masking, sampling, when to stop) is one piece of code, ``drafter.py``;
the model under it is a backend that keeps its own KV cache: eager torch (``torch_lm.py``) or an
exported graph on onnxruntime. Both satisfy :class:`DraftLM`, so the loop and the tests never care
which one drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Draft:
    tokens: list[int]
    q: torch.Tensor | None  # [len(tokens), drafter vocab] when the verification rule needs it, else None
    context: Sequence[int] = ()  # the drafter ids it continues (what a rule that re-queries the drafter needs)
    limit: int = 0  # the most tokens it could have had (the k it was drafted with)
    read_s: float = 0.0  # seconds spent reading the context before the first token (cache catch-up)
    read_tokens: int = 0  # tokens that read fed (the context past the cache's common prefix)
    runners_up: list[int] = field(default_factory=list)  # the best other allowed token at each position (-1: none)
    # token healing (``vocab/healing.py``): the bytes of the text's last drafter token, which ``context``
    # leaves out and the first drafted token spells again (b"": the draft continues all of the text)
    overlap: bytes = b""


class DraftLM(Protocol):
    """A causal LM with a KV cache that follows a token list (the drafter's backend)."""

    vocab_size: int
    hidden_size: int
    max_positions: int

    def logits_for(self, ids: Sequence[int]) -> torch.Tensor:
        """[vocab] float32 logits after the last id; the cache keeps the common prefix with ``ids``."""

    def step(self, token: int) -> torch.Tensor:
        """[vocab] float32 logits after feeding one token behind the cached ones (the hot path)."""

    @property
    def last_hidden(self) -> torch.Tensor:
        """[hidden] the final hidden state (the LM head's input) at the last fed position."""

    def reset(self) -> None:
        """Forget the cache (after the weights changed, or a step was cut short)."""

    def fork(self) -> DraftLM:
        """Another instance with the same weights and a cache of its own (concurrent sessions)."""

    # Optional: ``drop(start, n)`` forgets cached positions [start, start + n) and moves the later ones
    # down (their keys re-rotated), so a sliding window costs no re-read (``Drafter.window``).

    def apply_adapter(self, state: dict[str, torch.Tensor] | None, scaling: float = 1.0, keep_cache: bool = False) -> None:
        """Use LoRA tensors (peft names; None: the base weights). Checked before anything changes.
        ``keep_cache``: keep the KV cache computed under the previous weights (the next version of one
        adapter: its keys differ from the old ones by far less than the drafter's own errors, and the
        verifier keeps the output exact, while re-reading a long context costs seconds); else the
        backend may drop it."""
