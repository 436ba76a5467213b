"""Local torch target (Algorithm 1, lines 10-11): one forward over new context + proposals.

The backend interface is deliberately small so a remote target (gRPC) is just another backend:
``score(ids, m)`` returns the target's logits predicting the token after each of the last m+1 ids
(i.e. after the context and after each of the m proposals). The backend keeps its own KV cache
and crops it to the common prefix with ``ids``, so a rejection costs nothing extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from omnidraft.kv import CachedLM


class TargetBackend(Protocol):
    tokenizer: object
    vocab_size: int
    eos_ids: frozenset[int]

    def score(self, ids: Sequence[int], num_proposed: int) -> torch.Tensor: ...

    def reset(self) -> None: ...


def eos_ids_of(model, tokenizer) -> frozenset[int]:
    """The ids that end generation: the generation config's, as transformers' generate uses."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class LocalTarget:
    """A transformers causal LM on this machine."""

    def __init__(self, model: torch.nn.Module, tokenizer) -> None:
        self.lm = CachedLM(model)
        self.tokenizer = tokenizer
        self.vocab_size = self.lm.vocab_size
        self.eos_ids = eos_ids_of(model, tokenizer)

    def score(self, ids: Sequence[int], num_proposed: int) -> torch.Tensor:
        return self.lm.logits_for(ids, keep=num_proposed + 1)

    def reset(self) -> None:
        self.lm.reset()
