"""The target half of the loop: what every target backend provides.

``score(ids, m)`` returns the target's logits predicting the token after each of the last m+1 ids
(after the context and after each of the m proposals), from one forward over what is not cached
yet. The backend keeps its own KV cache and crops it to the common prefix with ``ids``, so a
rejection costs nothing extra. Backends: eager torch on this machine (``torch_target.py``); the
verification rule then runs on those rows wherever the target runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class Target(Protocol):
    tokenizer: Any  # the target's transformers tokenizer
    vocab_size: int  # width of a logit row
    eos_ids: frozenset[int]  # ids that end generation
    max_context: int  # positions the target can hold

    def score(self, ids: Sequence[int], num_proposed: int) -> torch.Tensor:
        """float32 [num_proposed + 1, vocab_size] logits."""

    def reset(self) -> None:
        """Forget the KV cache."""


def eos_ids_of(model: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end generation: the generation config's, as transformers' generate uses."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
