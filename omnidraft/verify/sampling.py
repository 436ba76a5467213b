"""Temperature and nucleus (top-p) filtering, applied identically to target and draft logits."""

from __future__ import annotations

import torch

from omnidraft.verify import MIN_TEMPERATURE_F32


def step_generator(seed: int, position: int) -> torch.Generator:
    """The randomness of the token at ``position``: a function of (seed, position) only, so a server
    that holds no state between calls samples exactly what a local run would."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(position)) % (2**63))


def position_generator(step: torch.Generator, offset: int) -> torch.Generator:
    """The randomness of the position ``offset`` tokens after the one ``step`` was made for:
    ``step_generator(seed, position + offset)``, from the step's generator alone."""
    return torch.Generator().manual_seed((step.initial_seed() + offset) % (2**63))


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities after temperature and top-p; temperature 0 is the greedy limit (one-hot argmax).

    Finite for every temperature: below ``MIN_TEMPERATURE`` (1e-4; subnormals included, where
    ``logits / T`` overflows to inf and the softmax to NaN) the distribution is the greedy limit it
    tends to; otherwise the logits are shifted by their maximum before the division, so no quotient
    exceeds 0 and a huge temperature only flattens the distribution. A masked (-inf) logit keeps
    probability 0 at any temperature.
    """
    if temperature != temperature:  # NaN: no distribution to speak of
        raise ValueError("temperature is NaN")
    if temperature < MIN_TEMPERATURE_F32:  # 1e-4 as the float32 a remote request carries
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    shifted = logits.float() - logits.float().amax(-1, keepdim=True)
    scaled = torch.where(torch.isneginf(shifted), shifted, shifted / temperature)  # -inf / inf would be NaN
    probs = torch.softmax(scaled, dim=-1)
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
    pays at least once. A row with no finite positive mass (NaN or inf from upstream) is an error,
    never a silent draw of the last index.
    """
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    total = float(cdf[-1])
    if not 0.0 < total < float("inf"):
        raise ValueError(f"cannot draw from a distribution with total mass {total}")
    u = torch.rand((), generator=generator, dtype=torch.float64) * total
    return min(int(torch.searchsorted(cdf, u, right=True)), len(probs) - 1)
