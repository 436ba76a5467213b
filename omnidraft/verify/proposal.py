"""What a verification rule is given: the proposed target ids, and for the sampling rules the
drafter's distribution in target space (q', eq. (2)) behind a declared interface.

A rule that needs only ids (``RuleInfo.ids_only``) reads ``proposal.proposed`` and nothing else,
which is why lookup drafts and a remote target can use it. The rejection-sampling rules read q'
through :class:`DraftDistribution`; SLRS with a longer lookahead also needs ψ of single tokens
(:class:`StringDistribution`). The translators implement these; the rules never see more of them.
Torch-free at import (the types are annotations only), like the rule registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from omnidraft.drafter.base import Draft
    from omnidraft.verify.tree import Branch
    from omnidraft.vocab.bridge import Translation


class DraftDistribution(Protocol):
    """q' of a draft over the target vocabulary (what rejection sampling compares p with)."""

    def draft_target_probs(self, draft: Draft, tr: Translation, i: int) -> torch.Tensor:
        """q' at proposal i."""

    def null_proposal(self, draft: Draft, tr: Translation, proposed: int) -> torch.Tensor | None:
        """q' of the drafted position after the last proposal when the draft ended on a token with
        no translation (a proposal that is always rejected), else None."""


class StringDistribution(DraftDistribution, Protocol):
    """SLRS: ψ, the string-level probability of a first target token (``vocab/slrs.py``)."""

    whole_rows: bool  # ψ is known over the whole vocabulary (lookahead 1): several proposals per draft

    def psi(self, draft: Draft, t: int) -> tuple[float, int]:
        """(ψ(t), drafter forwards it took) for the string drafted in ``draft``."""


class SamplingConfig(Protocol):
    """The fields of a decoding config a rule reads (``omnidraft.config.DecodeConfig`` has them)."""

    verify: str
    temperature: float
    top_p: float
    seed: int


class Rule(Protocol):
    """A verification rule: (proposals accepted, the next token) from the target's m+1 rows."""

    def verify(self, logits: torch.Tensor, proposal: Proposal, config: SamplingConfig,
               generator: torch.Generator) -> tuple[int, int]: ...


@dataclass
class Proposal:
    """One step's proposal: target ids, and where they came from when a rule needs to know."""

    proposed: list[int]
    draft: Draft | None = None  # the drafter's tokens and q (None: target ids from a lookup)
    translation: Translation | None = None  # how the draft became ``proposed``
    q: DraftDistribution | None = None  # q' of the draft (the translator that made it)
    branches: list[Branch] = field(default_factory=list)  # other ways the chain could go (greedy: ``verify.tree``)
