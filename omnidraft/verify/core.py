"""Greedy and rejection-sampling verification (Algorithm 1, lines 10-16).

``greedy``: accept while t_i == argmax p_i, then emit argmax p — the target's own greedy output.
``omnidraft``/``tli``: accept t_i with probability min(1, p(t_i)/q'(t_i)); on rejection sample the
residual norm(max(0, p - q')); after m acceptances sample a bonus token from p_{m+1}. ``tli``
differs only in what q' is (the drafter restricted to the vocabulary intersection, Alg. 4 of the
heterogeneous-vocabulary paper), which the drafter and bridge decide, not this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from omnidraft.config import VERIFIERS  # noqa: F401  (re-exported)


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Temperature + nucleus filtering, applied identically to target and draft logits.

    Temperature 0 is the greedy limit: a one-hot distribution on the argmax.
    """
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_verify(target_logits: torch.Tensor, proposed: Sequence[int]) -> tuple[int, int]:
    """(number accepted, next token) for greedy decoding: lossless w.r.t. the target's argmax."""
    choice = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(proposed) and proposed[n] == choice[n]:
        n += 1
    return n, choice[n]


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
        return i, int(torch.multinomial(dist, 1, generator=generator))
    last = len(proposed)
    dist = target_probs[last]
    if last_draft is not None:
        residual = (dist - last_draft).clamp_min(0.0)
        if float(residual.sum()) > 0:
            dist = residual / residual.sum()
    return last, int(torch.multinomial(dist, 1, generator=generator))
