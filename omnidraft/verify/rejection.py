"""Speculative rejection sampling over the target vocabulary (Algorithm 1, lines 10-16).

Accept t_i with probability min(1, p(t_i)/q'(t_i)); on rejection sample the residual
norm(max(0, p − q')); after m acceptances sample a bonus token from p_{m+1}. The ``omnidraft`` and
``tli`` rules differ only in what q' is (the paper's eq. (2) with n-gram merges, or the drafter
restricted to the vocabulary intersection, Alg. 4 of the heterogeneous-vocabulary paper), which the
translator computes; this module only sees q' rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from omnidraft.verify.proposal import Proposal, SamplingConfig, StringDistribution
from omnidraft.verify.sampling import draw, position_generator, probs_from_logits


def sample_verify(
    target_probs: torch.Tensor,
    proposed: Sequence[int],
    draft_probs: Callable[[int], torch.Tensor],
    generator: torch.Generator,
    last_draft: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Speculative rejection sampling; ``draft_probs(i)`` is q' over the target vocabulary at i.

    ``last_draft``: when the draft ended at position m because the drafter sampled a token with no
    target translation (mass 1 - sum q'), that "null proposal" is always rejected, so the next
    token comes from the residual of q'_m, not from p — which keeps the output distributed as p.
    """
    for i, tok in enumerate(proposed):
        q = draft_probs(i)
        p_tok, q_tok = float(target_probs[i, tok]), float(q[tok])
        if q_tok > 0 and torch.rand((), generator=generator).item() * q_tok <= p_tok:
            continue  # accepted with probability min(1, p/q')
        residual = (target_probs[i] - q).clamp_min(0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else target_probs[i]
        return i, draw(dist, generator)
    last = len(proposed)
    dist = target_probs[last]
    if last_draft is not None:
        residual = (dist - last_draft).clamp_min(0.0)
        if float(residual.sum()) > 0:
            dist = residual / residual.sum()
    return last, draw(dist, generator)


class RejectionSampling:
    """q' comes from the translator (eq. (2)); the rule itself is the same for omnidraft and tli."""

    def verify(self, logits: torch.Tensor, proposal: Proposal, config: SamplingConfig,
               generator: torch.Generator) -> tuple[int, int]:
        p = probs_from_logits(logits, config.temperature, config.top_p)
        q, draft, tr = proposal.q, proposal.draft, proposal.translation
        return sample_verify(p, proposal.proposed, lambda i: q.draft_target_probs(draft, tr, i), generator,
                             q.null_proposal(draft, tr, len(proposal.proposed)))


def deterministic_verify(target_probs: torch.Tensor, proposed: Sequence[int], generator: torch.Generator) -> tuple[int, int]:
    """Rejection sampling of a deterministic draft, q = δ(t_i) at every position, as sample-and-compare.

    At position i the target's own token x_i ~ p_i is drawn with that position's randomness
    (``position_generator``); t_i is kept when x_i = t_i, else x_i is emitted and the step ends.
    That keeps t_i with probability p(t_i) = min(1, p(t_i)/q(t_i)), and on rejection x_i follows p
    with t_i removed and renormalised, norm(max(0, p − δ(t_i))): speculative sampling's residual
    (Algorithm 1, lines 10-16, with q' = δ), so every emitted token is distributed exactly as the
    target's p whatever was proposed. Because x_i is the very draw a plain step at that position
    makes, the output is also *identical* to the target sampling alone with the same seed, whatever
    was drafted, when and by whom (lookup, the drafter through text translation, a remote device).
    """
    for i in range(len(proposed) + 1):
        token = draw(target_probs[i], position_generator(generator, i))
        if i == len(proposed) or token != proposed[i]:
            return i, token
    raise AssertionError("unreachable")


class DeterministicDraftSampling:
    """The ``text-sample`` rule: exact sampling with the drafter's greedy proposals (see above)."""

    def verify(self, logits: torch.Tensor, proposal: Proposal, config: SamplingConfig,
               generator: torch.Generator) -> tuple[int, int]:
        p = probs_from_logits(logits, config.temperature, config.top_p)
        return deterministic_verify(p, proposal.proposed, generator)


RESIDUAL_TRIES = 10_000  # draws of the residual by rejection before falling back (never reached in practice)


class StringRejectionSampling:
    """The ``slrs`` rule (Timor et al., Algorithm 3): the proposal of position i is a target token
    whose string-level probability ψ the translator knows (``vocab/slrs.py``).

    Lookahead 1: ψ is known over the whole vocabulary, so this is ``sample_verify`` with ψ as q',
    several positions per step. Longer lookahead: one drafted string, one target token t: accept it
    if p(t) ≥ ψ(t), else with probability p(t)/ψ(t) (lines 6-7); on rejection sample
    norm(p − min(p, ψ)) (line 8) by rejection — draw c ~ p and keep it with probability
    1 − min(p(c), ψ(c))/p(c) — which needs ψ only for the candidates drawn. After an accept the
    bonus token comes from p at the next position, as in any speculative step.
    """

    def verify(self, logits: torch.Tensor, proposal: Proposal, config: SamplingConfig,
               generator: torch.Generator) -> tuple[int, int]:
        p = probs_from_logits(logits, config.temperature, config.top_p)
        translator: StringDistribution = proposal.q
        draft, tr = proposal.draft, proposal.translation
        if translator.whole_rows or not proposal.proposed:
            return sample_verify(p, proposal.proposed, lambda i: translator.draft_target_probs(draft, tr, i), generator)
        t = proposal.proposed[0]
        psi_t, _ = translator.psi(draft, t)
        if psi_t <= 0 or torch.rand((), generator=generator).item() * psi_t <= float(p[0, t]):
            return 1, draw(p[1], generator)
        for _ in range(RESIDUAL_TRIES):
            c = draw(p[0], generator)
            p_c = float(p[0, c])
            psi_c = psi_t if c == t else translator.psi(draft, c)[0]
            if torch.rand((), generator=generator).item() * p_c < p_c - min(p_c, psi_c):
                return 0, c
        return 0, draw(p[0], generator)
