"""The streaming server's wait for the device's next draft, without a model.

After a forward that corrected the device's line, no draft the server holds continues the text: the
device hears of the correction a round trip later and drafts from it. The server waits for that
draft only where the wait is shorter than what a plain step would lose (``ProposalBudget.worth_waiting``),
for at most that long, and stops waiting once the device's lags run past it (``Patience``). The real
pair over a real server is in test_rpc.py; the speed is measured by the bench (docs/remote.md).
"""

from __future__ import annotations

import threading
import time

from omnidraft.rpc.server import Drafts, Patience, ProposalBudget, SessionBudget

VOCAB, LIMIT = 100, 1000
STEP = 0.2  # seconds of a plain step of a slow CPU target


def budget_with(cost, acceptance: float, forwards: int = 40) -> tuple[ProposalBudget, SessionBudget]:
    """A server's budget whose forwards cost ``cost(k)`` and a session whose drafts keep each
    proposal with probability about ``acceptance`` (a deterministic stand-in: the expected count)."""
    budget = ProposalBudget()
    plan = budget.session()
    for i in range(forwards):
        k = [0, 1, 2, 4][i % 4]
        kept = int(round(sum(acceptance ** j for j in range(1, k + 1)))) if k else 0
        plan.learn(k, min(kept, k), cost(k), reads_prompt=i == 0)
    return budget, plan


def test_a_slow_flat_target_is_worth_waiting_for_and_a_dear_verify_is_not():
    """On a target whose verify of a few rows costs a plain step, a wait pays up to about a_1 steps
    (the renewal bound V(0) + a_1 V(k - 1) - V(k)); where each verified row costs most of a step, no
    draft pays, so no wait does either."""
    flat, plan = budget_with(lambda k: STEP, acceptance=0.8)
    k, worth = flat.worth_waiting(plan.acceptance, 8)
    assert k >= 2 and 0.3 * STEP < worth <= STEP

    dear, plan = budget_with(lambda k: STEP * (1 + 0.9 * k), acceptance=0.3)
    assert dear.worth_waiting(plan.acceptance, 8) == (0, 0.0)


def test_a_wait_ends_when_a_draft_of_the_wanted_length_arrives():
    drafts = Drafts(VOCAB, LIMIT)
    ids = [0] * 10

    def device() -> None:
        time.sleep(0.02)
        drafts.put(10, [1, 2])  # too short: the server waits on
        time.sleep(0.02)
        drafts.put(10, [1, 2, 3, 4])

    thread = threading.Thread(target=device)
    start = time.monotonic()
    thread.start()
    usable, forked = drafts.wait(ids, 8, want=3, timeout=5.0)
    thread.join()
    assert usable == [1, 2, 3, 4] and not forked
    assert time.monotonic() - start < 2.5  # woken by the draft, not the deadline


def test_a_wait_ends_when_the_devices_line_stops_growing():
    """Chunks of one line come every ~10 ms, then none: the wait ends a couple of intervals after the
    last, with what came, long before its deadline."""
    drafts = Drafts(VOCAB, LIMIT)
    ids = [0] * 10

    def device() -> None:
        for n in range(2, 8, 2):
            drafts.put(10, list(range(1, n + 1)))
            time.sleep(0.01)

    thread = threading.Thread(target=device)
    start = time.monotonic()
    thread.start()
    usable, _ = drafts.wait(ids, 8, want=8, timeout=5.0)
    thread.join()
    assert usable == [1, 2, 3, 4, 5, 6]
    assert time.monotonic() - start < 2.5
    assert drafts.chunk_s is not None and drafts.chunk_s < 1.0


def test_a_wait_ends_at_its_deadline_or_when_the_stream_ends():
    drafts = Drafts(VOCAB, LIMIT)
    drafts.put(10, [1])
    start = time.monotonic()
    assert drafts.wait([0] * 10, 8, want=3, timeout=0.05) == ([1], False)  # what there is at the deadline
    assert time.monotonic() - start >= 0.05

    ended = Drafts(VOCAB, LIMIT)
    ended.read(iter([]))  # the device's stream closed: no draft will come
    start = time.monotonic()
    assert ended.wait([0] * 10, 8, want=3, timeout=5.0) == ([], False)
    assert time.monotonic() - start < 2.5


def test_a_device_too_late_to_pay_is_waited_for_only_until_it_misses_twice():
    """No draft ever comes: the first waits run to their bound, and after ``MISSES`` of them the
    stream waits no more."""
    budget, plan = budget_with(lambda k: 0.02, acceptance=0.8)  # a fast target: each wait is short
    patience, drafts = Patience(budget), Drafts(VOCAB, LIMIT)
    _, worth = budget.worth_waiting(plan.acceptance, 8)
    assert worth > 0
    for _ in range(Patience.MISSES):
        usable, _, waited = patience.wait(drafts, [0] * 10, 8, plan)
        assert usable == [] and waited >= worth * 0.9
    for _ in range(5):
        assert patience.wait(drafts, [0] * 10, 8, plan) == ([], False, 0.0)


def test_a_device_whose_drafts_come_near_the_bound_is_no_longer_waited_for():
    """Drafts that do come, but each after most of what the wait is worth: it stops waiting."""
    budget, plan = budget_with(lambda k: 0.05, acceptance=0.8)
    patience, drafts = Patience(budget), Drafts(VOCAB, LIMIT)
    _, worth = budget.worth_waiting(plan.acceptance, 8)
    ids = [0] * 10
    timer = threading.Timer(0.9 * worth, drafts.put, args=(len(ids), [1] * 8))
    timer.start()
    usable, _, waited = patience.wait(drafts, ids, 8, plan)
    timer.join()
    assert usable and waited >= 0.85 * worth
    assert patience.wait(drafts, ids + [1], 8, plan) == ([], False, 0.0)


def test_a_device_that_answers_in_time_keeps_being_waited_for():
    budget, plan = budget_with(lambda k: STEP, acceptance=0.8)
    patience, drafts = Patience(budget), Drafts(VOCAB, LIMIT)
    for n in range(3):
        ids = [0] * (10 + n)
        timer = threading.Timer(0.01, drafts.put, args=(len(ids), [1, 2, 3, 4, 5, 6, 7, 8]))
        timer.start()
        usable, _, waited = patience.wait(drafts, ids, 8, plan)
        timer.join()
        assert usable and 0 < waited < STEP


def test_a_device_whose_drafts_come_too_late_rests_and_is_tried_again_less_often():
    """A draft usable one forward in ten, where a verify gains 7%: drafting pays 0.7% over plain steps,
    under the 2% worth drafting for, so the device rests; each try that is still late rests it twice
    as long. A device on time is never rested, whatever its gain."""
    from omnidraft.rpc.server import Lateness

    late = Lateness()
    rests, forwards = [], 0
    while len(rests) < 3:
        was = late.resting
        late.forward(usable=forwards % 10 == 0, gain=1.07)
        forwards += 1
        if late.resting and not was:
            rests.append(late.rest_left)
    assert rests == [Lateness.FIRST, 2 * Lateness.FIRST, 4 * Lateness.FIRST]
    assert forwards < 3 * 10 + 16 + 32 + 3 * 10  # each try noticed within a few forwards
    on_time = Lateness()
    for i in range(500):
        on_time.forward(usable=i % 4 != 0, gain=1.3)  # three forwards in four: 22% over plain steps
    assert not on_time.resting and on_time.backoff == Lateness.FIRST


def test_while_the_device_is_late_the_server_asks_for_no_draft():
    """``wants`` is 0 while the device rests for lateness, though a draft that arrives is still verified."""
    budget, plan = budget_with(lambda k: STEP, acceptance=0.8)
    assert plan.wants(8) > 0
    for _ in range(20):
        plan.heard(drafting=True, usable=False, k_max=8)
    assert plan.lateness.resting and plan.wants(8) == 0
    assert plan.choose(4) > 0  # a draft at hand is verified all the same
    for _ in range(plan.lateness.rest_left):
        plan.heard(drafting=False, usable=False, k_max=8)
    assert not plan.lateness.resting and plan.wants(8) > 0
