"""The distillation loss (eq. (3)/(4)) against values computed by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from omnidraft.train.loss import (
    LossConfig,
    coarse_divergence,
    hybrid_loss,
    hybrid_loss_sum,
    intersection_log_probs,
    ngram_nll,
)


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) if p > 0 else -30.0 for p in probs]])


def test_intersection_log_probs_renormalise_over_direct_mapped_tokens():
    logq = intersection_log_probs(_logits([0.1, 0.3, 0.6]), torch.tensor([True, True, False]))
    assert torch.allclose(logq[0, :2].exp(), torch.tensor([0.25, 0.75]))
    assert logq[0, 2] == float("-inf")


def test_coarse_kl_with_full_top_k_is_the_exact_reverse_kl():
    # q_I = (0.25, 0.75) over drafter tokens 0, 1; p = (0.1, 0.7, 0.2) over target tokens 0, 1, 2
    # where target 2 has no drafter partner, so p_I = (0.125, 0.875).
    logq = intersection_log_probs(_logits([0.25, 0.75, 0.0]), torch.tensor([True, True, False]))
    pre = torch.tensor([[[1], [0]]])  # top-2 target tokens (1, 0) and their drafter preimages
    kl = coarse_divergence(logq, pre, torch.tensor([[math.log(0.7), math.log(0.1)]]), torch.tensor([math.log(0.8)]))
    expected = 0.25 * math.log(0.25 / 0.125) + 0.75 * math.log(0.75 / 0.875)
    assert kl.item() == pytest.approx(expected, abs=1e-6)


def test_coarse_kl_lumps_the_rest_and_never_exceeds_the_exact_kl():
    # q_I = (0.5, 0.3, 0.2), p_I = (0.6, 0.3, 0.1) (p's intersection mass 1), top-1 = token 0.
    logq = intersection_log_probs(_logits([0.5, 0.3, 0.2]), torch.tensor([True, True, True]))
    kl = coarse_divergence(logq, torch.tensor([[[0]]]), torch.tensor([[math.log(0.6)]]), torch.tensor([0.0]))
    coarse = 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4)
    exact = 0.5 * math.log(0.5 / 0.6) + 0.3 * math.log(0.3 / 0.3) + 0.2 * math.log(0.2 / 0.1)
    assert kl.item() == pytest.approx(coarse, abs=1e-6)
    assert kl.item() < exact


def test_forward_kl_and_tvd_on_the_same_coarse_buckets():
    # q_I = (0.25, 0.75), p_I = (0.125, 0.875), as in the exact reverse-KL test above.
    logq = intersection_log_probs(_logits([0.25, 0.75, 0.0]), torch.tensor([True, True, False]))
    args = (logq, torch.tensor([[[1], [0]]]), torch.tensor([[math.log(0.7), math.log(0.1)]]), torch.tensor([math.log(0.8)]))
    forward = 0.125 * math.log(0.125 / 0.25) + 0.875 * math.log(0.875 / 0.75)
    assert coarse_divergence(*args, divergence="forward-kl").item() == pytest.approx(forward, abs=1e-6)
    assert coarse_divergence(*args, divergence="tvd").item() == pytest.approx(0.125, abs=1e-6)  # ½(0.125 + 0.125)


def test_target_temperature_sharpens_p_before_the_kl():
    # Full top-k (no rest): p_I = (0.125, 0.875) at T = 0.5 becomes (0.125², 0.875²) / Z.
    logq = intersection_log_probs(_logits([0.25, 0.75, 0.0]), torch.tensor([True, True, False]))
    pre = torch.tensor([[[1], [0]]])
    args = (logq, pre, torch.tensor([[math.log(0.7), math.log(0.1)]]), torch.tensor([math.log(0.8)]))
    z = 0.125 ** 2 + 0.875 ** 2
    p0, p1 = 0.125 ** 2 / z, 0.875 ** 2 / z
    expected = 0.25 * math.log(0.25 / p0) + 0.75 * math.log(0.75 / p1)
    assert coarse_divergence(*args, temperature=0.5).item() == pytest.approx(expected, abs=1e-5)
    assert coarse_divergence(*args, temperature=1.0).item() < coarse_divergence(*args, temperature=0.5).item()


def test_several_drafter_tokens_for_one_target_token_add_up():
    # Drafter tokens 0 and 1 both spell target token T0; drafter 2 spells T1. q'(T0) = 0.2 + 0.3.
    logq = intersection_log_probs(_logits([0.2, 0.3, 0.5]), torch.tensor([True, True, True]))
    pre = torch.tensor([[[2, -1]]])  # top-1 target token is T1 (p_I = 0.6); M = 2 with a pad
    kl = coarse_divergence(logq, pre, torch.tensor([[math.log(0.6)]]), torch.tensor([0.0]))
    assert kl.item() == pytest.approx(0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4), abs=1e-6)
    pre_t0 = torch.tensor([[[0, 1]]])  # top-1 is T0 with p_I = 0.5: q'(T0) = 0.5 matches exactly
    kl0 = coarse_divergence(logq, pre_t0, torch.tensor([[math.log(0.5)]]), torch.tensor([0.0]))
    assert kl0.item() == pytest.approx(0.0, abs=1e-6)


def test_kl_gradient_is_finite_with_masked_tokens_and_zero_mass():
    logits = torch.tensor([[0.0, 2.0, -1.0, 50.0]], requires_grad=True)
    logq = intersection_log_probs(logits, torch.tensor([True, True, True, False]))
    pre = torch.tensor([[[1], [0], [2]]])  # the whole intersection: p's rest mass is exactly 0
    kl = coarse_divergence(logq, pre, torch.log(torch.tensor([[0.7, 0.3, 0.0]])), torch.tensor([0.0]))
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logits.grad).all()
    assert logits.grad[0, 3] == 0  # a token outside the intersection gets no gradient from L_DM


def test_ngram_nll_is_the_drafter_nll_over_its_full_vocabulary():
    nll = ngram_nll(_logits([0.25, 0.75]), torch.tensor([1]))
    assert nll.item() == pytest.approx(-math.log(0.75), abs=1e-6)


def test_hybrid_loss_weights():
    dm_kl = torch.tensor([0.1, 0.3])
    nll = torch.tensor([1.0, 2.0])
    logp_t = torch.log(torch.tensor([0.5, 0.25]))
    assert hybrid_loss(dm_kl, nll, logp_t, LossConfig("dm")).item() == pytest.approx(0.2)
    assert hybrid_loss(dm_kl, nll, logp_t, LossConfig("hybrid", "const", 0.2)).item() == pytest.approx((0.4 + 0.2 * 3) / 4)
    assert hybrid_loss(dm_kl, nll, logp_t, LossConfig("hybrid", "target-prob")).item() == pytest.approx((0.4 + 0.5 + 0.5) / 4)
    total, count = hybrid_loss_sum(dm_kl, nll, logp_t, LossConfig("dm"))
    assert count == 2 and total.item() == pytest.approx(0.4)


def test_straddling_tokens_join_the_mean_only_with_a_span_weight():
    dm_kl, nll, logp_t = torch.tensor([0.1, 0.3]), torch.tensor([1.0, 2.0]), torch.log(torch.tensor([0.5, 0.25]))
    span = torch.tensor([4.0])
    hybrid = LossConfig("hybrid", "const", 0.2)
    assert hybrid_loss(dm_kl, nll, logp_t, hybrid, span).item() == pytest.approx((0.4 + 0.2 * 3) / 4)  # weight 0: eq. (4)
    with_span = LossConfig("hybrid", "const", 0.2, span_weight=0.5)
    assert hybrid_loss(dm_kl, nll, logp_t, with_span, span).item() == pytest.approx((0.4 + 0.2 * 3 + 0.5 * 4) / 5)
    total, count = hybrid_loss_sum(dm_kl, nll, logp_t, LossConfig("dm", span_weight=0.5), span)
    assert count == 3 and total.item() == pytest.approx(0.4 + 2.0)
