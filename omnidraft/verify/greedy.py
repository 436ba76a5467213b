"""Greedy verification: accept while t_i == argmax p_i, then emit argmax p (Algorithm 1, lines 10-16
at temperature 0). The output is token for token the target's own greedy decode, whatever the
drafter proposed, so any translation (text or tokens) is allowed."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omnidraft.verify.proposal import Proposal, SamplingConfig


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The argmax of each row (the first of equal maxima, as torch and numpy both pick). On a CPU
    float32 row of a large vocabulary numpy's argmax is an order of magnitude faster than torch's,
    which a llama.cpp verify would otherwise pay on every step."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu":
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def greedy_verify(target_logits: torch.Tensor, proposed: Sequence[int]) -> tuple[int, int]:
    """(number accepted, next token) for greedy decoding: lossless w.r.t. the target's argmax."""
    choice = argmax_rows(target_logits)
    n = 0
    while n < len(proposed) and proposed[n] == choice[n]:
        n += 1
    return n, choice[n]


class Greedy:
    def verify(self, logits: torch.Tensor, proposal: Proposal, config: SamplingConfig,
               generator: torch.Generator) -> tuple[int, int]:
        return greedy_verify(logits, proposal.proposed)
