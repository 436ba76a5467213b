"""The draft-length cost model on synthetic costs: speculate only when tokens/second go up."""

from __future__ import annotations

import math

import pytest

from omnidraft.costs import (
    FIRST_WEIGHT,
    STALL_FACTOR,
    AcceptanceStats,
    DraftCost,
    SequentialDraft,
    VerifyCosts,
    best_draft_length,
    expected_rates,
    expected_tokens,
    should_continue,
)

STEP = 0.020  # a plain target step, seconds


def linear(per_token: float):
    """Compute-bound target: an eval of k + 1 new tokens costs (k + 1) * per_token."""
    return lambda k: (k + 1) * per_token


def flat(step: float):
    """Memory-bound target: any few-token verify costs one step."""
    return lambda k: step


def llamacpp_like(k: int) -> float:  # Qwen-0.5B on llama.cpp: 1/2/4/8 new tokens = 20/37/51/87 ms
    return VerifyCosts.from_eval_ms({1: 20, 2: 37, 4: 51, 8: 87})(k)


# ------------------------------------------------------------------------------------ the maths


def test_expected_tokens_formula():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.0, 5) == 1.0
    assert math.isclose(expected_tokens([0.8, 0.5, 0.25], 3), 1 + 0.8 + 0.4 + 0.1)
    assert math.isclose(expected_tokens(0.5, 3), 1 + 0.5 + 0.25 + 0.125)
    assert math.isclose(expected_tokens([0.9], 3), 1 + 0.9 + 0.81 + 0.729)  # a short list repeats its last


def test_expected_rates_matches_definition():
    a, d, V = [0.9, 0.8, 0.7], 0.003, linear(0.01)
    r = expected_rates(a, d, V, 3)
    for k in range(4):
        assert math.isclose(r[k], expected_tokens(a, k) / (k * d + V(k)))


# ------------------------------------------------------------------------------ picks k = 0 ...


def test_no_speculation_when_verify_cost_is_linear_in_tokens():
    # every proposal costs a full step to verify: even a free, perfect drafter only breaks even
    assert best_draft_length(1.0, 0.0, linear(STEP), 8) == 0
    assert best_draft_length(0.95, 0.001, linear(STEP), 8) == 0
    for i in range(4):
        p = 0.95 ** i
        assert not should_continue(i, p, 0.95, 0.001, linear(STEP), expected_so_far=expected_tokens(0.95, i), k_max=8)


def test_no_speculation_with_a_slow_drafter():
    # drafting a token costs as much as a target step: cannot pay even with a flat verify cost
    assert best_draft_length(0.9, STEP, flat(STEP), 8) == 0
    assert not should_continue(0, 1.0, 0.9, STEP, flat(STEP), k_max=8)


def test_no_speculation_with_low_acceptance():
    assert best_draft_length(0.05, 0.004, flat(STEP), 8) == 0
    assert best_draft_length(0.2, 0.004, llamacpp_like, 8) == 0


# ---------------------------------------------------------------------------- ... or a larger k


def test_long_drafts_on_a_memory_bound_target():
    k = best_draft_length(0.9, 0.001, flat(STEP), 16)
    assert k >= 8
    assert best_draft_length(1.0, 0.0, flat(STEP), 16) == 16


def test_llamacpp_like_costs_pay_with_high_acceptance():
    k = best_draft_length(0.9, 0.002, llamacpp_like, 8)
    assert k > 0
    r = expected_rates(0.9, 0.002, llamacpp_like, 8)
    assert r[k] == max(r) and r[k] > r[0]


def test_monotone_in_acceptance_drafter_cost_and_verify_slope():
    ks = [best_draft_length(a, 0.001, flat(STEP), 16) for a in (0.01, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] > 4
    ks = [best_draft_length(0.85, d, flat(STEP), 16) for d in (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02)]
    assert ks == sorted(ks, reverse=True) and ks[-1] == 0
    ks = [best_draft_length(0.9, 0.001, lambda k, s=s: STEP * (1 + s * k), 16) for s in (0.0, 0.1, 0.3, 0.6, 1.0)]
    assert ks == sorted(ks, reverse=True) and ks[-1] == 0


def test_position_dependent_acceptance():
    # the third proposal is almost never accepted after two good ones: stop at 2
    assert best_draft_length([0.95, 0.95, 0.01, 0.9], 0.001, flat(STEP), 4) == 2


def test_input_validation():
    with pytest.raises(ValueError):
        best_draft_length(1.5, 0.0, flat(STEP), 4)
    with pytest.raises(ValueError):
        best_draft_length(0.5, -1.0, flat(STEP), 4)
    with pytest.raises(ValueError):
        VerifyCosts({})


# ------------------------------------------------------------------ sequential = all-at-once


@pytest.mark.parametrize("a", [0.5, 0.8, 0.9, 0.97, [0.95, 0.9, 0.6, 0.9, 0.9, 0.3, 0.99, 0.99]])
@pytest.mark.parametrize("V", [flat(STEP), linear(STEP), llamacpp_like,
                               VerifyCosts({0: 0.150, 1: 0.26, 2: 0.27, 3: 0.24, 7: 0.24})])  # non-monotone torch-like
@pytest.mark.parametrize("d", [0.0005, 0.003, 0.02])
def test_sequential_stops_where_best_draft_length_says(a, V, d):
    k_max = 8
    rates = a if isinstance(a, list) else [a] * k_max
    plan = SequentialDraft(d, V, k_max)
    while plan.i < k_max and plan.should_continue(rates[plan.i], rates[plan.i + 1:]):
        plan.push(rates[plan.i])
    assert plan.i == best_draft_length(rates, d, V, k_max)


def test_sequential_lookahead_skips_a_costly_odd_length():
    # V(1) is expensive, V(2) cheap: one more token alone does not pay, two do
    V = VerifyCosts({0: 0.020, 1: 0.060, 2: 0.022, 3: 0.080})
    assert best_draft_length(0.95, 0.0005, V, 3) == 2
    assert should_continue(0, 1.0, 0.95, 0.0005, V, expected_so_far=1.0, k_max=3)


def test_sequential_uses_confidence():
    d, V = 0.001, llamacpp_like
    plan = SequentialDraft(d, V, 8)
    plan.push(0.99)
    assert plan.should_continue(0.99)
    plan.push(0.05)  # the drafter is unsure of the second token: nothing after it is likely to land
    assert not plan.should_continue(0.9)


# ------------------------------------------------------------------------ online statistics


def test_verify_costs_interpolation_and_extrapolation():
    V = VerifyCosts.from_eval_ms({1: 20, 2: 37, 4: 51, 8: 87})  # new tokens -> ms
    assert V.table == {0: 0.020, 1: 0.037, 3: 0.051, 7: 0.087}
    assert math.isclose(V(2), (0.037 + 0.051) / 2)
    assert math.isclose(V(5), 0.051 + (0.087 - 0.051) / 2)
    assert math.isclose(V(9), 0.087 + 2 * (0.087 - 0.051) / 4)  # last slope continues
    only = VerifyCosts({1: 0.04})
    assert math.isclose(only(0), 0.02) and math.isclose(only(3), 0.08)  # proportional to new tokens
    dropping = VerifyCosts({0: 0.1, 4: 0.05})
    assert math.isclose(dropping(8), 0.05)  # a falling slope is not extrapolated below the last point


def test_verify_costs_ema():
    V = VerifyCosts({0: 0.020, 3: 0.050}, alpha=0.25)
    V.observe(0, 0.040)
    assert math.isclose(V(0), 0.025)
    for _ in range(200):
        V.observe(0, 0.040)
    assert math.isclose(V(0), 0.040, rel_tol=1e-6)
    before = V(1)
    V.observe(1, 0.070)  # unmeasured: starts from the interpolation, first weight 0.5
    assert math.isclose(V(1), before + 0.5 * (0.070 - before))
    assert 1 in V.table and V.observations[1] == 1
    V.observe(2, float("nan"))
    V.observe(2, -1.0)
    assert 2 not in V.table


def test_a_one_off_stall_moves_the_verify_cost_at_most_by_the_stall_factor():
    """A verify that stalled once (a GC pass, a kernel timed on its first call) must not make its k
    look prohibitive: the policy would never draft it again, so never see its real cost."""
    V = VerifyCosts({0: 0.068, 4: 0.111, 6: 0.122})
    expected = V(5)
    V.observe(5, 0.775)
    assert V(5) <= expected + FIRST_WEIGHT * (STALL_FACTOR * 0.122 - expected) + 1e-12
    assert V(5) < 0.16  # not 0.45, what the stall would have made it
    for _ in range(60):  # the largest known k is taken as observed: a cost that really is higher gets there
        V.observe(6, 0.500)
    assert V(6) > 0.45


def test_a_stall_on_the_first_verify_of_a_new_largest_k_is_capped_too():
    """A new largest k has no larger neighbour to bound it: its first observation counts as at most
    STALL_FACTOR times the extrapolation (a first call for a new row count that stalled for 1.7 s once
    made V(9) read 926 ms after V(8) = 137 ms); repeated observations still count in full."""
    V = VerifyCosts({0: 0.069, 4: 0.109, 8: 0.137})
    expected = V(9)
    V.observe(9, 1.7)
    assert V(9) <= expected + FIRST_WEIGHT * (STALL_FACTOR * expected - expected) + 1e-12
    for _ in range(60):
        V.observe(9, 0.400)
    assert V(9) > 0.35


def test_verify_costs_observations_change_the_decision():
    V = VerifyCosts.flat(STEP)  # optimistic guess: verify is free
    assert best_draft_length(0.8, 0.002, V, 8) > 0
    for _ in range(100):  # ... but the loop sees each proposal cost a full step
        for k in range(9):
            V.observe(k, (k + 1) * STEP)
    assert best_draft_length(0.8, 0.002, V, 8) == 0


def test_a_table_timed_in_a_slow_moment_follows_the_plain_steps_where_the_loop_never_verified():
    """V timed while another process had the cores (V(0) 105 ms against 45 ms in the loop, and V(4)
    278 ms): plain steps observe V(0) at the real speed, and the points no verify has observed
    follow it in proportion (their measured shape is kept); an observed point keeps its evidence."""
    V = VerifyCosts({0: 0.105, 1: 0.130, 2: 0.245, 4: 0.278})
    V.observe(1, 0.070)
    v1 = V(1)
    for _ in range(80):
        V.observe(0, 0.045)
    factor = V(0) / 0.105
    assert V(0) < 0.047
    assert V(2) == pytest.approx(0.245 * factor) and V(4) == pytest.approx(0.278 * factor)
    assert V(1) == v1  # observed: not scaled
    assert V(4) / V(0) == pytest.approx(0.278 / 0.105)


def test_a_table_with_stalls_is_made_monotone_where_it_is_given():
    """The table a home kept after an `adapt` run that a test run shared the cores with:
    V(1) and V(4) read 250 and 278 ms between points of ~70 ms. Each point is lowered to the least
    of the points at larger k; the larger-k points, and a table already monotone, are unchanged."""
    V = VerifyCosts({0: 0.058, 1: 0.250, 2: 0.071, 3: 0.081, 4: 0.278, 5: 0.069, 7: 0.087, 8: 0.317, 9: 0.315})
    assert V.table == {0: 0.058, 1: 0.069, 2: 0.069, 3: 0.069, 4: 0.069, 5: 0.069, 7: 0.087, 8: 0.315, 9: 0.315}
    assert V(6) == pytest.approx((0.069 + 0.087) / 2)  # interpolated between the repaired neighbours
    steady = {0: 0.060, 1: 0.062, 2: 0.066, 4: 0.070, 8: 0.088}
    assert VerifyCosts(steady).table == steady


def test_draft_cost_ema():
    d = DraftCost(alpha=0.5)
    assert not d.known and d.seconds_per_token == 0.0
    d.observe(4, 0.040)
    assert math.isclose(float(d), 0.010)
    d.observe(2, 0.040)
    assert math.isclose(float(d), 0.015)
    d.observe(0, 1.0)
    d.observe(3, float("inf"))
    assert math.isclose(float(d), 0.015) and d.observations == 2
    assert math.isclose(float(DraftCost(0.004)), 0.004)


def test_acceptance_stats_conditional_counts():
    s = AcceptanceStats(4, prior_mean=0.5, prior_strength=2.0)
    assert s.rates() == [0.5] * 4
    s.update(proposed=4, accepted=2)  # positions 1, 2 accepted; 3 rejected; 4 never reached
    assert s.tried == [1, 1, 1, 0] and s.accepted == [1, 1, 0, 0]
    s.update(proposed=3, accepted=3)  # all accepted, position 4 not proposed
    assert s.tried == [2, 2, 2, 0] and s.accepted == [2, 2, 1, 0]
    assert math.isclose(s.rate(1), (2 + 1) / (2 + 2))
    assert math.isclose(s.rate(3), (1 + 1) / (2 + 2))
    assert s.rate(4) == 0.5 and s.rate(9) == s.rate(4)  # beyond K shares the last position
    s.update(proposed=6, accepted=5)  # positions past K fold into the last
    assert s.tried[3] == 3 and s.accepted[3] == 2
    s.update(proposed=0, accepted=0)
    assert s.steps == 3
    with pytest.raises(ValueError):
        s.update(proposed=2, accepted=3)


def test_acceptance_stats_converge_and_decay():
    s = AcceptanceStats(3)
    for _ in range(1000):
        s.update(3, 3)
    assert s.rate(1) > 0.99 and s.expected_tokens(3) > 3.9
    forgetful = AcceptanceStats(3, decay=0.9)
    for _ in range(100):
        forgetful.update(3, 3)
    for _ in range(50):
        forgetful.update(3, 0)
    assert forgetful.rate(1) < 0.1  # the recent misses dominate (the prior is what is left)
    fixed = AcceptanceStats(3)
    for _ in range(100):
        fixed.update(3, 3)
    for _ in range(50):
        fixed.update(3, 0)
    assert fixed.rate(1) > 0.6


def test_stats_drive_the_decision():
    s = AcceptanceStats(8)
    V, d = VerifyCosts.from_eval_ms({1: 20, 2: 37, 4: 51, 8: 87}), DraftCost(0.002)
    for _ in range(200):
        s.update(8, 0)
    assert best_draft_length(s.rates(), d, V, 8) == 0
    for _ in range(2000):
        s.update(8, 8)
    assert best_draft_length(s.rates(), d, V, 8) > 0
