"""Training the acceptance head (OmniDraft §3.3, Algorithm 3): its loss and its saved tensors.

The head itself (eq. (5)-(7)), which decoding runs, lives in ``omnidraft.adapter.head``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omnidraft.adapter.head import AcceptHead


def weighted_bce(logit: torch.Tensor, label: torch.Tensor, reject_weight: float = 1.0) -> torch.Tensor:
    """Summed weighted BCE (L_adapt): −[l·log σ(z) + w·(1 − l)·log(1 − σ(z))] per token.

    With soft labels l ∈ [0, 1] (min(1, p/q) under sampling) each token's weight is l + w·(1 − l),
    split between the two terms, which is the same thing when l is 0 or 1."""
    per_token = F.binary_cross_entropy_with_logits(logit, label, reduction="none")
    weight = label + reject_weight * (1 - label)
    return (per_token * weight).sum()


def state_of(head: AcceptHead) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in head.state_dict().items()}
