"""A transformers causal LM on this machine as the target (Algorithm 1, lines 10-11)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omnidraft.kv import CachedLM, max_positions_of
from omnidraft.target.base import eos_ids_of


class TorchTarget:
    """:class:`~omnidraft.target.base.Target` over an eager torch model with a KV cache."""

    def __init__(self, model: torch.nn.Module, tokenizer) -> None:
        self.lm = CachedLM(model)
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = self.lm.vocab_size
        self.eos_ids = eos_ids_of(model, tokenizer)
        self.max_context = max_positions_of(model)

    def score(self, ids: Sequence[int], num_proposed: int) -> torch.Tensor:
        return self.lm.logits_for(ids, keep=num_proposed + 1)

    def session(self) -> TorchTarget:
        """Another target over the same weights with a KV cache of its own (the gRPC server's sessions)."""
        return TorchTarget(self.model, self.tokenizer)

    def reset(self) -> None:
        self.lm.reset()

    def warm_up(self, max_proposals: int) -> None:
        """Run a verify of every draft length up to ``max_proposals`` once (see ``CachedLM.warm_up``)."""
        self.lm.warm_up(max_proposals + 1)
