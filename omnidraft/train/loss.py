"""The hybrid cross-vocabulary distillation loss, OmniDraft eq. (3)/(4).

    L = L_DM + λ·L_N-gram
      = E[ KL(q'_θ ‖ p)(t_i) · I_DM(d_i)  −  λ · log q_θ(d_i) · I_N-gram(d_i) ]

* At a direct-mapping (DM) position the drafter's distribution, moved onto the target vocabulary
  through the direct mapping (q', eq. (2) without n-grams) and restricted to the vocabulary
  intersection, is pulled towards the target's by the *reverse* KL (mode-seeking: what greedy
  acceptance rewards).
* At an n-gram sub-token (a target token that the drafter spells with n >= 2 tokens) only a point
  value of p is known, so the drafter's own token gets a weighted NLL: λ constant (TrainConfig's)
  or the verified target probability p(t) of the n-gram's token (§3.2, "point-wise KL").

The target distribution is stored sparsely (see ``records.py``): its top-k tokens over the
intersection plus the remaining intersection mass. The KL is then computed between the two
distributions *coarsened* to those k tokens plus one "rest" bucket. By the data-processing
inequality this never exceeds the exact KL, and it is exact when p's rest mass is zero; the
README reports how close it is for the k we use, measured on the real models.

All functions are plain tensors in, tensors out, so they are tested on hand-computed values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOG_FLOOR = -80.0  # exp(-80) ~ 1e-35: keeps 0·log 0 finite without changing any real value


def intersection_log_probs(drafter_logits: torch.Tensor, dm_mask: torch.Tensor) -> torch.Tensor:
    """log q restricted to the direct-mapped drafter tokens and renormalised there ([N, V_d])."""
    masked = drafter_logits.float().masked_fill(~dm_mask, float("-inf"))
    return masked.log_softmax(-1)


def coarse_divergence(logq_i: torch.Tensor, topk_pre: torch.Tensor, topk_logp: torch.Tensor,
                      log_mass: torch.Tensor, temperature: float = 1.0, divergence: str = "reverse-kl") -> torch.Tensor:
    """KL(q' ‖ p) (or another ``divergence``) per position over {top-k of p} ∪ {rest}, both restricted to the intersection.

    logq_i:    [N, V_d] drafter log-probs over the intersection (``intersection_log_probs``).
    topk_pre:  [N, k, M] drafter ids whose direct mapping is each top-k target token (-1 pads;
               M > 1 only when several drafter tokens spell the same bytes).
    topk_logp: [N, k] the target's log-probs of those tokens over its full vocabulary.
    log_mass:  [N] log of the target's total probability on the intersection.
    temperature: p is sharpened to p^(1/T) (renormalised) first, the target's distribution at the
               decoding temperature (the paper trains and decodes at T = 0.01, §4); the rest
               bucket is sharpened as if it were one token, which over-states its mass.
    """
    n, k, m = topk_pre.shape
    # Every top-k target token has at least one preimage (column 0); pads repeat it, so gathers
    # and scatters stay in range. Pads are masked out of the sum; scattering a repeat is harmless.
    filled = torch.where(topk_pre >= 0, topk_pre, topk_pre[..., :1]).reshape(n, k * m)
    gathered = logq_i.gather(1, filled).reshape(n, k, m).masked_fill(topk_pre < 0, float("-inf"))
    logq_k = gathered.logsumexp(-1).clamp_min(LOG_FLOOR)  # q'(t) = sum over t's preimages, eq. (2)
    # Rest bucket of q': everything but the top-k preimages, computed exactly (no 1 - sum cancellation).
    # (-inf entries are floored first: a logsumexp over nothing but -inf has a NaN gradient.)
    logq_rest = logq_i.scatter(1, filled, float("-inf")).clamp_min(-1e4).logsumexp(-1).clamp_min(LOG_FLOOR)
    logp_k = (topk_logp - log_mass[:, None]).clamp_min(LOG_FLOOR)  # p renormalised over the intersection
    p_rest = (1.0 - logp_k.exp().sum(-1)).clamp_min(0.0)
    logp_rest = torch.log(p_rest.clamp_min(1e-30))
    if temperature != 1.0:
        sharp = (torch.cat([logp_k, logp_rest[:, None]], 1) / temperature).log_softmax(-1).clamp_min(LOG_FLOOR)
        logp_k, logp_rest = sharp[:, :-1], sharp[:, -1]
    logq = torch.cat([logq_k, logq_rest[:, None]], 1)
    logp = torch.cat([logp_k, logp_rest[:, None]], 1)
    return _DIVERGENCE_FNS[divergence](logq, logp)


def _reverse_kl(logq: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(q ‖ p), eq. (4)'s mode-seeking choice."""
    return (logq.exp() * (logq - logp)).sum(-1)


def _forward_kl(logq: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q), the mass-covering one (DistillSpec compares both)."""
    return (logp.exp() * (logp - logq)).sum(-1)


def _tvd(logq: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Total variation ½Σ|p − q|: one minus the sampling acceptance rate of Leviathan et al. (2023)."""
    return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)


_DIVERGENCE_FNS = {"reverse-kl": _reverse_kl, "forward-kl": _forward_kl, "tvd": _tvd}


def ngram_nll(drafter_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """−log q_θ(d_i) over the full drafter vocabulary, per token ([N]): n-gram sub-tokens, and the
    straddling tokens when they are trained on."""
    return -drafter_logits.float().log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)


@dataclass
class LossConfig:
    """Which terms and weights: ``kind`` "dm" (L_DM only) or "hybrid" (eq. (3));
    ``ngram_weight`` "const" (λ) or "target-prob" (the verified p(t) per n-gram token);
    ``span_weight``: weight of the NLL on drafter tokens that straddle a target-token boundary
    (``records.KIND_SPAN``; not in the paper, 0 = eq. (4) as written)."""

    kind: str = "hybrid"
    ngram_weight: str = "const"
    lam: float = 0.2
    span_weight: float = 0.0


def hybrid_loss_sum(dm_kl: torch.Tensor, ng_nll: torch.Tensor, ng_logp_target: torch.Tensor,
                    config: LossConfig, span_nll: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Eq. (4) as (sum over labelled tokens, their count), so micro-batches add up to the batch mean.

    ``dm``: KL at DM positions only. ``hybrid``: KL at DM positions + weighted NLL at n-gram
    sub-tokens, averaged over both kinds of labelled token. With ``span_weight`` > 0 the straddling
    tokens' NLL (``span_nll``) joins as a third kind of labelled token.
    """
    total, count = dm_kl.sum(), dm_kl.numel()
    if config.kind == "hybrid":
        weight = ng_logp_target.exp() if config.ngram_weight == "target-prob" else torch.full_like(ng_nll, config.lam)
        total, count = total + (weight * ng_nll).sum(), count + ng_nll.numel()
    if config.span_weight > 0 and span_nll is not None:
        total, count = total + config.span_weight * span_nll.sum(), count + span_nll.numel()
    return total, count


def hybrid_loss(dm_kl: torch.Tensor, ng_nll: torch.Tensor, ng_logp_target: torch.Tensor,
                config: LossConfig, span_nll: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. (3)/(4): the mean over a batch's labelled tokens (0 when there is none)."""
    total, count = hybrid_loss_sum(dm_kl, ng_nll, ng_logp_target, config, span_nll)
    return total / max(count, 1)
