"""How the drafter drafts: which token it picks, which it may pick, and when it stops.

A :class:`DraftPolicy` bundles three small strategies, each behind its own interface:

- a :class:`Sampler` picks the next token from the (masked) logits: argmax for greedy
  verification, a sample from q (temperature, top-p, kept for the verifier) for rejection sampling;
- a constraint (the translator's, ``omnidraft.vocab.translate``) says which drafter tokens the
  bridge can carry, as an additive logit bias;
- a stop rule ends a draft early: when one more token is no longer expected to raise tokens per
  second (the default, which the cost policy supplies: ``omnidraft/sources/policy.py``), never (fixed length), after a token the drafter
  itself doubts (confidence), or once the acceptance head's P(some drafted token is rejected)
  exceeds γ (OmniDraft §3.3, eq. (5)–(7)).

A new rule is one class here, its name in ``config.DRAFT_STOPS`` and a branch in :func:`stop_rule`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from omnidraft.adapter.head import AcceptHead, should_stop
from omnidraft.config import DRAFT_STOPS
from omnidraft.errors import OmnidraftError
from omnidraft.verify.sampling import draw, probs_from_logits


class DraftConstraint(Protocol):
    """Which drafter tokens may come next (supplied by the translator)."""

    def start(self) -> None: ...
    def bias(self) -> torch.Tensor: ...
    def advance(self, token: int) -> None: ...


@dataclass
class Sampler:
    """Picks a drafted token; keeps q (the distribution it was drawn from) when the verifier needs it."""

    temperature: float = 0.0
    top_p: float = 1.0
    keep_q: bool = False
    generator: torch.Generator | None = None

    def choose(self, masked: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if self.temperature <= 0 and not self.keep_q:
            return int(masked.argmax()), None
        q = probs_from_logits(masked, self.temperature, self.top_p)
        if self.temperature <= 0:
            return int(masked.argmax()), q
        return draw(q, self.generator), q

    def feed(self, token: int) -> list[int]:
        """The drafter ids that carry a chosen token into the drafter's context (itself, here;
        a sampler that chooses in target ids feeds the token's drafter spelling)."""
        return [token]


class StopRule(Protocol):
    """Decides, after each drafted token, whether the draft ends there (the token is still proposed)."""

    def start(self) -> None: ...

    def stop_after(self, token: int, masked: torch.Tensor, q: torch.Tensor | None,
                   hidden: torch.Tensor, logits: torch.Tensor) -> bool: ...


class FixedLength:
    """Always draft all k tokens (the paper's SpD setting, Algorithm 1)."""

    def start(self) -> None:
        pass

    def stop_after(self, token, masked, q, hidden, logits) -> bool:
        return False


@dataclass
class ConfidenceStop:
    """Stop after a token the drafter gives less than ``threshold`` probability: a doubtful token is
    rarely accepted, and every token drafted after it is wasted drafter time."""

    threshold: float

    def start(self) -> None:
        pass

    def stop_after(self, token, masked, q, hidden, logits) -> bool:
        prob = float(q[token]) if q is not None else float(torch.softmax(masked, -1)[token])
        return prob < self.threshold


class HeadStop:
    """eq. (5)–(7): stop once 1 − Π P(accepted) over the drafted tokens exceeds γ."""

    def __init__(self, head: AcceptHead, gamma: float) -> None:
        self.head, self.gamma = head, gamma
        self._probs: list[float] = []

    def start(self) -> None:
        self._probs = []

    def stop_after(self, token, masked, q, hidden, logits) -> bool:
        self._probs.append(self.head.accept_prob(hidden, logits))
        return should_stop(self._probs, self.gamma)


@dataclass
class DraftPolicy:
    sampler: Sampler
    constraint: DraftConstraint
    stop: StopRule
    runners_up: bool = False  # note the best other token at each position (a token tree's branches)


def stop_rule(name: str, head: AcceptHead | None, confidence: float, gamma: float) -> StopRule:
    """The stop rule ``name`` names; ``head``: eq. (7) with γ. ``auto`` is the cost policy's own
    (``CostPolicy.stop_rule``, with the acceptance head's estimates when the adapter has a head)."""
    if name == "auto":
        raise ValueError("the cost-aware stop rule comes from the cost policy (CostPolicy.stop_rule)")
    if name == "head" and head is None:
        raise OmnidraftError("--draft-stop head needs an adapter with an acceptance head (train one with "
                             "`omnidraft adapt`), or use --draft-stop auto")
    if name == "head":
        return HeadStop(head, gamma)
    if name == "fixed" or confidence <= 0:
        return FixedLength()
    if name == "confidence":
        return ConfidenceStop(confidence)
    raise OmnidraftError(f"unknown draft stop {name!r}; choose one of {', '.join(DRAFT_STOPS)}")
