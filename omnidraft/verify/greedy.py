"""Greedy verification: accept while t_i == argmax p_i, then emit argmax p (Algorithm 1, lines 10-16
at temperature 0). The output is token for token the target's own greedy decode, whatever the
drafter proposed, so any translation (text or tokens) is allowed."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omnidraft.verify.proposal import Proposal, SamplingConfig


def greedy_verify(target_logits: torch.Tensor, proposed: Sequence[int]) -> tuple[int, int]:
    """(number accepted, next token) for greedy decoding: lossless w.r.t. the target's argmax."""
    choice = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(proposed) and proposed[n] == choice[n]:
        n += 1
    return n, choice[n]


class Greedy:
    def verify(self, logits: torch.Tensor, proposal: Proposal, config: SamplingConfig,
               generator: torch.Generator) -> tuple[int, int]:
        return greedy_verify(logits, proposal.proposed)
