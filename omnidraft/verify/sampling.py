"""Temperature and nucleus (top-p) filtering, applied identically to target and draft logits."""

from __future__ import annotations

import torch


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities after temperature and top-p; temperature 0 is the greedy limit (one-hot argmax)."""
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


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One index drawn with probability proportional to ``probs`` (1-D, non-negative, any total).

    Inverse CDF in float64: exact up to rounding, and on a vocabulary-wide row faster than
    ``torch.multinomial`` (one cumulative sum and one binary search), which a sampled decode step
    pays at least once.
    """
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), len(probs) - 1)
