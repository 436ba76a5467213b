"""The cost policy on synthetic costs: it never drafts when drafting cannot pay, drafts
when it can, and the output stays the target's either way (tiny random models)."""

from __future__ import annotations

import math

import pytest

from tiny import holding_costs, tiny_pair

from omnidraft.config import DecodeConfig
from omnidraft.costs import DRAFT_MIN_GAIN, EVEN_PRIOR, DraftCost, VerifyCosts, best_draft_length, expected_rates
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import make_drafter
from omnidraft.sources.base import Offer, StepResult, StepTimes
from omnidraft.sources.lookup import LONG_MATCH, LONG_MATCH_PRIOR, match_key, match_prior
from omnidraft.sources.policy import (
    CATCH_UP_HORIZON,
    DRAFTER,
    EXPLORE_EVERY,
    EXPLORE_MAX,
    EXPLORE_SHARE,
    OPTIMISTIC_ACCEPTANCE,
    CostAwareStop,
    CostPolicy,
    NoCostPolicy,
    explore_length,
)
from omnidraft.verify.proposal import Proposal

LLAMA_CPP = {0: 0.020, 1: 0.037, 3: 0.051, 7: 0.087}  # Qwen-0.5B on llama.cpp: compute-bound


def measured_policy(verify: VerifyCosts, drafter_s: float) -> CostPolicy:
    b = CostPolicy()
    b.verify_costs, b.draft_cost = verify, DraftCost(drafter_s)
    return b


def plan(b: CostPolicy, k_max: int) -> int:
    """How many tokens the policy lets the model drafter draft this step."""
    return b.allow(DRAFTER, False, k_max)


def plan_lookup(b: CostPolicy, k_max: int, key: str) -> int:
    return b.allow(key, True, k_max)


def step(key: str, free: bool, drafted: int, proposed: int, kept: int, draft_s: float, verify_s: float) -> StepResult:
    """A verified step as the decoder hands it to the policy."""
    return StepResult("context" if free else DRAFTER, key, free, Proposal([0] * proposed), drafted, kept, [], False,
                      None, StepTimes(draft_s, 0.0, verify_s), kept=kept)


def plain_step(verify_s: float = 0.0, emitted: list[int] | None = None) -> StepResult:
    """A plain target step (no source drafted), as the decoder hands it to the policy."""
    return StepResult(None, "", False, None, 0, 0, emitted or [], False, None, StepTimes(verify_s=verify_s))


def observe_step(b: CostPolicy, drafted: int, draft_s: float, proposed: int, verify_s: float, kept: int,
                 probs: list[float]) -> None:
    stop = b.stop_rule(8, None)
    stop.probs = list(probs)
    b.learn(step(DRAFTER, False, drafted, proposed, kept, draft_s, verify_s), reads_prompt=False)


def observe_lookup(b: CostPolicy, key: str, proposed: int, accepted: int, verify_s: float) -> None:
    b.learn(step(key, True, proposed, proposed, accepted, 0.0, verify_s), reads_prompt=False)


def test_no_draft_when_it_cannot_pay_even_when_the_drafter_is_always_right():
    b = measured_policy(VerifyCosts(LLAMA_CPP), drafter_s=0.030)  # a 30 ms drafter against a 20 ms step
    for _ in range(50):
        b.stats.update(8, 8)  # perfect acceptance: still slower than plain decoding
    assert all(plan(b, 8) == 0 for _ in range(3 * EXPLORE_EVERY))  # and no exploration: it cannot pay at all


def test_drafts_when_verifying_k_tokens_costs_about_one_step():
    b = measured_policy(VerifyCosts.flat(0.150), drafter_s=0.030)  # memory-bound fp32 target
    assert plan(b, 8) == 8
    for _ in range(200):
        b.stats.update(4, 0)  # a drafter that is always wrong
    assert plan(b, 8) == 0


def test_explorations_that_lose_time_become_rarer_and_one_that_pays_resets_them():
    b = measured_policy(VerifyCosts.flat(0.150), drafter_s=0.030)
    for _ in range(200):
        b.stats.update(4, 0)  # drafting does not pay: plain steps, with explorations
    gaps, last = [], 0
    for step in range(1, 2000):
        if plan(b, 8):
            gaps.append(step - last)
            last = step
            observe_step(b, 4, 0.12, 4, 0.16, 0, [0.5] * 4)  # the exploration lost time (1 token for 0.28 s)
    # each lost exploration at least doubles the gap; the budget may stretch it further
    assert all(g >= min(EXPLORE_EVERY * 2 ** i, EXPLORE_MAX) for i, g in enumerate(gaps)), gaps
    assert max(gaps) == EXPLORE_MAX
    lost_each = 0.28 / 0.150 - 1
    assert len(gaps) * lost_each <= EXPLORE_SHARE * 2000 + lost_each  # the budget: at most one over
    while not plan(b, 8):
        pass
    observe_step(b, 4, 0.12, 4, 0.16, 4, [0.9] * 4)  # 5 tokens for 0.28 s: it paid
    assert b.explorations[False].every == EXPLORE_EVERY


def test_new_adapter_weights_are_explored_soon_and_outweigh_the_old_evidence(tmp_path):
    """A trained adapter can make a drafter that never paid worth drafting; the policy's evidence
    about the old weights must not keep it at one exploration per EXPLORE_MAX steps."""
    b = measured_policy(VerifyCosts.flat(0.150), drafter_s=0.030)
    b.drafter_weights("none")
    for _ in range(200):
        b.stats.update(4, 0)  # the untrained drafter: always wrong
    for _ in range(6):  # explorations that lost time: the gap grew to its maximum
        while not plan(b, 8):
            pass
        observe_step(b, 4, 0.12, 4, 0.16, 0, [0.5] * 4)
    assert b.explorations[False].every == EXPLORE_MAX
    wrong = b.stats.tried[0]
    b.drafter_weights("none")  # the same weights again (a restart): nothing changes
    assert b.explorations[False].every == EXPLORE_MAX and b.stats.tried[0] == wrong
    b.drafter_weights("adapters/pair/v000003")
    assert b.explorations[False].every == EXPLORE_EVERY and b.stats.tried[0] < wrong / 3
    explored = next(i for i in range(1, EXPLORE_MAX) if plan(b, 8))
    assert explored < 2 * EXPLORE_EVERY  # the gap, or the budget's wait for one more lost exploration
    for _ in range(10):  # the adapted drafter is right: a few good drafts turn drafting on
        observe_step(b, 4, 0.12, 4, 0.16, 4, [0.9] * 4)
    assert plan(b, 8) == 8
    b.keep_at(tmp_path / "pair.json")
    b.save()
    again = CostPolicy()
    again.keep_at(tmp_path / "pair.json")
    assert again.weights == "adapters/pair/v000003"


def test_a_free_drafter_pays_on_llama_cpp_with_high_acceptance():
    b = measured_policy(VerifyCosts(LLAMA_CPP), drafter_s=0.0005)
    for _ in range(100):
        b.stats.update(4, 4)
    assert plan(b, 8) > 0


def test_the_stop_rule_ends_a_draft_at_a_doubtful_token():
    import torch

    b = measured_policy(VerifyCosts.flat(0.150), drafter_s=0.030)
    stop = CostAwareStop(b, k_max=8)
    stop.start()
    sure = torch.tensor([10.0, 0.0, 0.0])
    unsure = torch.tensor([0.1, 0.0, 0.0])
    assert not stop.stop_after(0, sure, None, torch.zeros(4), sure)  # q ≈ 1: go on
    assert stop.stop_after(0, unsure, None, torch.zeros(4), unsure)  # q ≈ 0.36: the next token will not pay
    assert len(stop.probs) == 2


def test_decoding_follows_the_policy_and_keeps_the_output():
    d_model, target, bridge = tiny_pair()
    prompt = target.tokenizer.encode("the cat sat on")
    config = DecodeConfig(max_new_tokens=24, draft_len=4)
    expected = SpeculativeDecoder(target).generate(prompt, config).token_ids
    losing = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)
    losing.cost_policy = holding_costs(measured_policy(VerifyCosts(LLAMA_CPP), drafter_s=0.030))
    assert losing.generate(prompt, config).token_ids == expected
    assert losing.stats.drafted_tokens == 0 and losing.stats.plain_steps == losing.stats.steps
    paying = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)
    paying.cost_policy = holding_costs(measured_policy(VerifyCosts.flat(0.150), drafter_s=0.001))
    assert paying.generate(prompt, config).token_ids == expected
    assert paying.stats.drafted_tokens > 0 and paying.cost_policy.stats.steps > 0


def test_costs_are_measured_at_the_first_request_and_timed_apart_from_it():
    d_model, target, bridge = tiny_pair()
    prompt = target.tokenizer.encode("the cat sat on")
    config = DecodeConfig(max_new_tokens=8)
    expected = SpeculativeDecoder(target).generate(prompt, config).token_ids
    decoder = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)
    first = decoder.generate(prompt, config)
    table = decoder.cost_policy.cost_table_ms()
    assert set(table) >= {0, 1, 2, 4, 8} and all(v > 0 for v in table.values())
    assert decoder.cost_policy.draft_cost.seconds_per_token > 0
    assert decoder.cost_policy.read_cost.known  # a catch-up read is not taken as free before the first one
    # the one-time measurement is reported on its own, not in the request's tok/s, and the engines
    # it used were reset: the request reads its prompt itself and decodes what the target alone does
    assert first.stats.measure_s > 0 and first.token_ids == expected
    second = decoder.generate(prompt, config)
    assert second.stats.measure_s == 0 and second.token_ids == expected


def test_what_a_process_measured_is_kept_for_the_next_one(tmp_path):
    path = tmp_path / "models" / "costs" / "pair@llamacpp-bfloat16.json"
    first = measured_policy(VerifyCosts(LLAMA_CPP), drafter_s=0.030)
    first.stats.update(4, 2)
    first.keep_at(path)
    first.save()
    again = CostPolicy()
    again.keep_at(path)
    assert again.measured and again.verify_costs.table == first.verify_costs.table
    assert again.draft_cost.seconds_per_token == 0.030 and again.stats.rates(4) == first.stats.rates(4)
    elsewhere = CostPolicy()  # another CPU or other kernels: the costs are measured again, the statistics kept
    elsewhere.keep_at(path, machine="another CPU; kernels none")
    assert not elsewhere.measured and elsewhere.stats.rates(4) == first.stats.rates(4)
    path.write_text('{"format": 1, "verify_s": {"0": -1}, "draft_s": "x"}')  # damaged: measured anew, no error
    fresh = CostPolicy()
    fresh.keep_at(path)
    assert not fresh.measured


def test_lookup_drafts_are_explored_where_only_a_good_source_pays_and_counted_per_source():
    """On llama.cpp a 1-proposal verify costs ~2 steps: at the prior's 0.5 no lookup draft pays, so
    the policy tries one now and then; once a source (a long match) shows it is right it is used,
    while a source that is often wrong stays off."""
    b = measured_policy(VerifyCosts({0: 0.016, 1: 0.037, 2: 0.047, 4: 0.067, 8: 0.081, 16: 0.150}), drafter_s=0.020)
    assert plan_lookup(b, 8, "context-4") == 0  # the prior: not worth it
    tries = 0
    for _ in range(1000):  # the first exploration waits until losing one is at most EXPLORE_SHARE of the steps
        k = plan_lookup(b, 8, "context-4")
        if k:
            tries += 1
            observe_lookup(b, "context-4", k, k, 0.081)  # all accepted: 9 tokens for one 81 ms verify
    assert tries >= 1 and plan_lookup(b, 8, "context-4") > 0
    assert b.explorations[True].every == EXPLORE_EVERY  # the explorations paid: no backoff
    for _ in range(30):
        observe_lookup(b, "context-2", 4, 0, 0.067)
    assert plan_lookup(b, 8, "context-2") == 0  # counted apart: the good source does not vouch for it
    restored = CostPolicy()
    assert restored.restore(b.state()) and plan_lookup(restored, 8, "context-4") > 0


def test_a_catch_up_read_after_plain_steps_does_not_inflate_the_drafters_cost():
    b = measured_policy(VerifyCosts.flat(0.150), drafter_s=0.010)
    b.stop_rule(8, None)
    caught_up = step(DRAFTER, False, drafted=4, proposed=4, kept=2, draft_s=0.210 + 0.030, verify_s=0.150)
    caught_up.times.catch_up_s = 0.200 + 0.010  # 40 skipped tokens read, then the first token's logits
    caught_up.times.catch_up_tokens = 40
    b.learn(caught_up, reads_prompt=False)
    assert abs(b.draft_cost.seconds_per_token - 0.010) < 1e-9  # 3 more tokens in 30 ms: d stays 10 ms
    assert abs(b.read_cost.seconds_per_token - 0.210 / 40) < 1e-9  # the read's own cost, per token read
    short = step(DRAFTER, False, drafted=2, proposed=2, kept=2, draft_s=0.110, verify_s=0.150)
    short.times.catch_up_s, short.times.catch_up_tokens = 0.100, 2  # two tokens: about a step each
    b.learn(short, reads_prompt=False)
    assert abs(b.read_cost.seconds_per_token - 0.210 / 40) < 1e-9  # a short read says nothing about a long one
    single = step(DRAFTER, False, drafted=1, proposed=1, kept=1, draft_s=0.200, verify_s=0.150)
    single.times.catch_up_s = 0.200
    b.learn(single, reads_prompt=False)  # nothing but the read: nothing learnt about d
    assert abs(b.draft_cost.seconds_per_token - 0.010) < 1e-9
    b.learn(step(DRAFTER, False, drafted=2, proposed=2, kept=2, draft_s=0.100, verify_s=0.150), reads_prompt=False)
    assert b.draft_cost.seconds_per_token > 0.010  # a slow draft while keeping up does count


def test_a_drafter_far_behind_the_text_is_not_woken_to_explore_where_a_draft_barely_pays():
    def due_explorations(unread: int) -> int:
        b = measured_policy(VerifyCosts({0: 0.030, 1: 0.045, 4: 0.080, 8: 0.140}), drafter_s=0.004)
        b.read_cost.observe(300, 0.450 * 8)  # 300 skipped tokens took 3.6 s to read last time (a slow drafter)
        for _ in range(200):
            b.stats.update(4, 0)  # drafting has not paid: only explorations would draft
        return sum(plan_unread(b, 8, unread) > 0 for _ in range(4 * EXPLORE_EVERY))

    assert due_explorations(0) > 0  # a drafter that is up to date explores now and then
    assert due_explorations(300) == 0  # reading 300 tokens first costs more than any draft could win


def plan_unread(b: CostPolicy, k_max: int, unread: int) -> int:
    return b.allow(DRAFTER, False, k_max, unread)


def test_a_lookup_exploration_on_a_compute_bound_target_verifies_a_few_tokens_not_all_it_could():
    """Where every verified row costs (llama.cpp on a CPU: 16 proposals cost ~9 steps), an exploration
    that loses must lose little: it drafts the length that would pay if the source were good, not
    k_max. Where a verify costs about one step (torch, a GPU) that length is k_max."""
    steep = measured_policy(VerifyCosts({0: 0.013, 1: 0.026, 2: 0.031, 4: 0.043, 8: 0.068, 16: 0.123}), drafter_s=0.005)
    flat = measured_policy(VerifyCosts.flat(0.070), drafter_s=0.005)
    for b in (steep, flat):
        for _ in range(40):
            observe_lookup(b, "context-4", 4, 0, 0.043)  # lookup has been wrong: only explorations draft
    explored = [k for _ in range(2000) if (k := plan_lookup(steep, 16, "context-4"))]
    assert explored and all(1 <= k <= 8 for k in explored), explored
    explored_flat = [k for _ in range(4 * EXPLORE_EVERY) if (k := plan_lookup(flat, 16, "context-4"))]
    assert explored_flat and all(k == 16 for k in explored_flat), explored_flat


GEMMA_LLAMA_CPP = {0: 0.0125, 1: 0.0257, 2: 0.031, 4: 0.043, 8: 0.068, 16: 0.124}  # every row costs


def test_explorations_lose_at_most_their_share_of_a_short_request_and_carry_their_budget_over():
    """Gemma-3-270M on llama.cpp: a lookup exploration that fails loses 2-4 plain steps. A fresh
    policy must not spend them in a 96-token request (that was 3-5% of it); once enough steps were
    decoded, across requests and processes, it explores with what the budget affords."""
    b = measured_policy(VerifyCosts(GEMMA_LLAMA_CPP), drafter_s=0.005)
    assert not any(plan_lookup(b, 16, "context-3") or plan(b, 8) for _ in range(96))
    restored = measured_policy(VerifyCosts(GEMMA_LLAMA_CPP), drafter_s=0.005)
    assert restored.restore(b.state()) and restored.explorations[True].steps == 96
    lookups, lost = [], 0.0
    for _ in range(2000):
        k = plan_lookup(restored, 16, "context-3")
        if k:
            lookups.append(k)
            verify_s = restored.verify_costs(k)
            observe_lookup(restored, "context-3", k, 0, verify_s)  # wrong every time
            lost += verify_s / GEMMA_LLAMA_CPP[0] - 1
    assert lookups and all(1 <= k <= 8 for k in lookups), lookups
    worst = max(restored.verify_costs(k) for k in lookups) / GEMMA_LLAMA_CPP[0] - 1
    assert lost <= EXPLORE_SHARE * (2000 + 96) + worst


def test_a_long_lookup_match_drafts_from_its_first_step_where_a_short_one_waits_for_evidence():
    """Where a verify costs several steps (llama.cpp on a CPU) an even prior never lets a lookup
    draft, and the exploration budget keeps a fresh policy from trying in a short request; a match
    of LONG_MATCH tokens is a copy, and its key's prior lets it draft at once. Its evidence then
    decides: a long match that keeps being wrong is turned off like any other source."""
    qwen = {0: 0.0209, 1: 0.0423, 2: 0.0549, 3: 0.0672, 4: 0.0797, 6: 0.1037, 8: 0.1290}  # Qwen-0.5B, llama.cpp
    b = measured_policy(VerifyCosts(qwen), drafter_s=0.005)
    short, long = match_key("context", 3), match_key("context", 12)
    assert (short, long) == ("context-3", f"context-{LONG_MATCH}") and match_key("context", 6) == "context-4"
    assert b.allow(short, True, 16, 0, match_prior(3)) == 0
    k = b.allow(long, True, 16, 0, match_prior(12))
    assert k > 0
    observe_lookup(b, long, k, 1, qwen[4])  # one unlucky draft does not turn a copy off
    assert b.allow(long, True, 16, 0, match_prior(12)) > 0
    for _ in range(6):
        observe_lookup(b, long, k, 0, qwen[4])  # copied text the target did not write
    assert b.allow(long, True, 16, 0, match_prior(12)) == 0
    restored = CostPolicy()
    assert restored.restore(b.state()) and (restored.acceptance[long].prior_mean, restored.acceptance[long].prior_strength) == LONG_MATCH_PRIOR


def test_a_long_match_that_stops_paying_in_this_text_is_turned_off_within_a_few_dozen_drafts():
    """Whether a copy continues is a property of the text being written: a key right 200 times in
    earlier text, now right and wrong in turn (a list whose items diverge after a few tokens), must
    stop drafting within this prompt, not after hundreds of drafts."""
    b = measured_policy(VerifyCosts(GEMMA_LLAMA_CPP), drafter_s=0.005)
    key, prior = match_key("context", 12), match_prior(12)
    for _ in range(200):
        observe_lookup(b, key, 5, 5, b.verify_costs(5))
    assert b.allow(key, True, 16, 0, prior) > 0
    drafted = []
    for i in range(40):
        k = b.allow(key, True, 16, 0, prior)
        drafted.append(k)
        if k:
            observe_lookup(b, key, k, k if i % 2 else 0, b.verify_costs(k))
    assert drafted[-10:] == [0] * 10, drafted


def test_of_the_offers_that_pay_the_one_expected_to_emit_the_most_tokens_per_second_drafts():
    """On a memory-bound target a two-token lookup at an even prior pays, and so does a drafter that
    is usually right: the drafter, expected to emit more per second, must draft (the first offer
    that pays used to, which left the drafter behind the text). A long match, a copy, beats it."""
    torch_like = {0: 0.100, 1: 0.104, 2: 0.108, 4: 0.116, 8: 0.132}  # a verify of 8 costs 1.3 steps
    b = measured_policy(VerifyCosts(torch_like), drafter_s=0.008)
    for _ in range(60):
        b.stats.update(8, 7)  # the drafter: about 0.9 of its tokens kept
    short = Offer(match_key("context", 2), 2, [1, 2], prior=match_prior(2))
    drafter = Offer(DRAFTER, 8)
    assert b.allow(short.key, True, 2, 0, short.prior) == 2  # alone, the lookup pays
    assert b.choose([(short, True), (drafter, False)]) == (1, 8)
    copy = Offer(match_key("context", 12), 8, list(range(8)), prior=match_prior(12))
    chosen, k = b.choose([(copy, True), (drafter, False)])
    assert chosen == 0 and k > 2
    b.stats.tried, b.stats.accepted = [0.0] * 16, [0.0] * 16
    for _ in range(60):
        b.stats.update(8, 0)  # a drafter that is always wrong: the short lookup is the better offer
    assert b.choose([(short, True), (drafter, False)]) == (0, 2)


def test_a_drafter_whose_best_case_barely_beats_a_plain_step_is_not_explored():
    """Qwen-0.5B on llama.cpp (a verified row costs most of a step) with a 5 ms drafter: at the
    best acceptance a real drafter reaches, a draft would beat a plain step by about 1%, which an
    exploration's verify and read never earn back. A target whose verify costs about a step is
    explored within EXPLORE_EVERY steps."""
    llama_cpp = {0: 0.023, 1: 0.040, 2: 0.051, 3: 0.061, 4: 0.073, 6: 0.093, 8: 0.116}  # measured in a bench
    b = measured_policy(VerifyCosts(llama_cpp), drafter_s=0.005)
    assert explore_length(0.005, b.verify_costs, 8, math.inf) == 0
    assert best_draft_length(OPTIMISTIC_ACCEPTANCE, 0.005, b.verify_costs, 8) > 0  # it could pay, barely
    assert all(plan(b, 8) == 0 for _ in range(20 * EXPLORE_MAX))
    flat = measured_policy(VerifyCosts({0: 0.050, 1: 0.051, 8: 0.055}), drafter_s=0.005)
    for _ in range(60):
        flat.stats.update(8, 0)  # turned off by its evidence
    assert any(plan(flat, 8) for _ in range(EXPLORE_EVERY))


def test_a_long_prompt_read_pays_back_over_the_request_not_over_one_draft():
    """A HumanEval prompt of ~200 drafter tokens: a drafter that pays once caught up must catch up at
    the start of a request (the read is spread over the tokens the request can still emit), but not
    near its end, where the same read cannot pay back. Spread over the next few drafts, the read
    kept the drafter out of whole requests on torch."""
    b = measured_policy(VerifyCosts({0: 0.060, 1: 0.070, 2: 0.078, 4: 0.095, 8: 0.125}), drafter_s=0.007)
    b.read_cost.observe(200, 200 * 0.0022)
    b.stats.tried, b.stats.accepted = [100.0] * b.k_max, [70.0] * b.k_max  # 0.7 per position
    assert b.allow(DRAFTER, False, 8, unread=200, room=127) > 0
    assert b.allow(DRAFTER, False, 8, unread=200, room=4) == 0
    assert b.allow(DRAFTER, False, 4, unread=0, room=4) > 0
    assert b.catch_up_per_token(200, room=127) == b.catch_up_per_token(200) == 200 * 0.0022 / CATCH_UP_HORIZON


def test_after_a_lookup_step_the_drafter_reads_its_tokens_as_a_catch_up_not_as_drafting():
    """The drafter's cost per token d is what drafting costs while it keeps up. The tokens a lookup
    step emitted must be read before the next draft: counted in d, they made every draft look
    dearer, and the drafter sat out most of a HumanEval request where lookup found matches."""
    d_model, target, bridge = tiny_pair()
    decoder = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)
    source = decoder.source(DRAFTER)
    ids = target.tokenizer.encode("the cat sat on the mat and the cat")
    source.begin(ids, DecodeConfig(max_new_tokens=32, draft_len=3, draft_stop="fixed"), NoCostPolicy())
    assert source.offer(ids, 16).unread > 0  # the prompt, before the first draft
    times = StepTimes()
    proposal = source.draft(ids, source.offer(ids, 16), 3, times)
    assert times.catch_up_tokens > 0 and times.catch_up_s > 0  # the prompt read
    nxt = ids[1]
    source.accept(StepResult(DRAFTER, DRAFTER, False, proposal, len(proposal.draft.tokens), 0, [nxt], False, None, times))
    ids = ids + [nxt]
    assert source.offer(ids, 16).unread == 0  # in step with its own draft: the rest is drafting
    looked_up = ids[2:6]
    source.accept(StepResult("context", "context-4", True, Proposal(looked_up[:-1]), 3, 3, looked_up, False, None,
                             StepTimes()))
    ids = ids + looked_up
    assert source.offer(ids, 16).unread >= len(looked_up)
    after = StepTimes()
    source.draft(ids, source.offer(ids, 16), 3, after)
    assert after.catch_up_tokens >= len(looked_up) and 0 < after.catch_up_s <= after.draft_s


def test_a_chinese_catch_up_is_priced_in_the_drafters_own_tokens(real_pipeline):
    """SmolLM2 spells most CJK characters as 2-3 byte tokens: a drafter that sat out a Chinese chat
    turn reads ~2.5x as many tokens as the target emitted. Priced per target token, the read looked
    cheap and the drafter caught up on whole conversations at a loss (a 20-turn Chinese chat ran at
    0.4-0.6x the target alone while it did)."""
    decoder, _, t_tok = real_pipeline("builtin:qwen2.5-coder-0.5b")
    source = decoder.source(DRAFTER)
    ids = t_tok.encode("请用三句话介绍一下长城的历史，并说明它为什么重要。长城是中国古代的军事防御工程。")
    source.begin(ids, DecodeConfig(max_new_tokens=16, draft_len=2, draft_stop="fixed"), NoCostPolicy())
    decoder.drafter.reset()
    promised = source.offer(ids, 8).unread
    times = StepTimes()
    source.draft(ids, source.offer(ids, 8), 2, times)
    assert promised > 1.5 * len(ids)  # byte tokens: far more than the target's count
    assert abs(promised - times.catch_up_tokens) <= 0.1 * times.catch_up_tokens


def test_after_plain_steps_and_into_the_next_turn_the_drafter_keeps_its_own_tokens(real_pipeline):
    """A plain step used to drop the drafter's context, rebuilt from the text when drafting resumed.
    Tokenized afresh, the reply no longer matched the tokens the drafter had drafted into its KV cache,
    so every resume read the reply again from its first drafted word: in a 20-turn Chinese chat, seconds
    of catch-up per turn, and the drafter drafting at a loss. A chat's next turn, whose prompt continues
    the text, rebuilt the context the same way."""
    from omnidraft.drafter import Draft

    decoder, _, t_tok = real_pipeline("builtin:qwen2.5-coder-0.5b")
    source, bridge, lm = decoder.source(DRAFTER), decoder.bridge, decoder.drafter.lm
    ids = t_tok.encode("def pick(a, b):\n    return")
    config = DecodeConfig(max_new_tokens=128, draft_len=8, draft_stop="fixed")
    source.begin(ids, config, NoCostPolicy())
    context = list(source._context(ids).ids)
    # a draft spelt one character per drafter token: the text, but not as the tokenizer spells it
    spelt = " a if a is not None else b"
    drafted = [bridge.drafter_tokenizer.encode(c, add_special_tokens=False)[0] for c in spelt]
    assert b"".join(bridge.drafter_bytes(t) for t in drafted) == spelt.encode()
    assert len(bridge.drafter_tokenizer.encode(spelt, add_special_tokens=False)) < len(drafted) - 16
    translator = source._plan.translator
    draft = Draft(drafted, None, context, len(drafted))
    tr = translator.forward(ids, draft)
    assert b"".join(bridge.target_bytes(t) for t in tr.target_ids) == spelt.encode()  # all of it proposed
    lm.reset()
    lm.logits_for(context + drafted[:-1])  # what drafting them left in its cache
    emitted = tr.target_ids + t_tok.encode("\n")
    source.accept(StepResult(DRAFTER, DRAFTER, False, Proposal(tr.target_ids, draft, tr, translator), len(drafted),
                             len(tr.target_ids), emitted, False, None, StepTimes()))
    plain = t_tok.encode("\ndef other(a, b):\n    return b")
    for token in plain:  # the policy sat these out
        source.accept(plain_step(emitted=[token]))
    text = ids + emitted + plain
    new_text = len(bridge.target_to_drafter(plain))
    offer = source.offer(text, 16)
    assert 0 < offer.unread <= new_text + 8
    after = StepTimes()
    source.draft(text, offer, 2, after)
    kept = len(context) + len(drafted) - 4  # the last few drafted tokens may be re-tokenized with the newline
    assert lm.cached_ids[:kept] == (context + drafted)[:kept]
    assert 0 < after.catch_up_tokens <= new_text + 8
    spell = b"".join(bridge.drafter_bytes(t) or b"" for t in source._context(text).ids)
    assert spell == b"".join(bridge.target_bytes(t) or b"" for t in text)
    # a request that continues this text (a chat's next turn) keeps the context and the drafter's tokens in it
    turn = text + t_tok.encode("\nprint(pick(1, 2))")
    source.begin(turn, config, NoCostPolicy())
    assert source._context(turn).ids[:kept] == (context + drafted)[:kept]
    # one that departs from the text near its end (a chat re-renders the last reply) keeps it up to there
    departed = turn[:-2] + t_tok.encode(" # done")
    source.begin(departed, config, NoCostPolicy())
    ctx = source._context(departed).ids
    assert ctx[:kept] == (context + drafted)[:kept]
    assert b"".join(bridge.drafter_bytes(t) or b"" for t in ctx) == b"".join(bridge.target_bytes(t) or b"" for t in departed)
    other = t_tok.encode("def pick(a, b):\n    return a")  # another text: built afresh
    source.begin(other, config, NoCostPolicy())
    assert source._context(other).ids == bridge.target_to_drafter(other)


def test_a_drafter_whose_cache_new_weights_dropped_reads_the_context_as_a_catch_up():
    """A trainer's new adapter version drops the drafter's KV cache between two steps of a request
    (``AdapterSlot``). The next draft reads the whole context again: counted as drafting, that read
    raised d several-fold after each published version, until the policy stopped drafting for good."""
    d_model, target, bridge = tiny_pair()
    decoder = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)
    source = decoder.source(DRAFTER)
    ids = target.tokenizer.encode("the cat sat on the mat and the cat")
    source.begin(ids, DecodeConfig(max_new_tokens=32, draft_len=3, draft_stop="fixed"), NoCostPolicy())
    times = StepTimes()
    proposal = source.draft(ids, source.offer(ids, 16), 3, times)
    source.accept(StepResult(DRAFTER, DRAFTER, False, proposal, len(proposal.draft.tokens), 0, [ids[1]], False, None,
                             times))
    ids = ids + [ids[1]]
    assert source.offer(ids, 16).unread == 0  # in step: the next draft is drafting only
    decoder.drafter.reset()  # what applying a new adapter does
    assert source.offer(ids, 16).unread >= len(ids) - 1  # the whole context, priced as a read
    after = StepTimes()
    source.draft(ids, source.offer(ids, 16), 3, after)
    assert after.catch_up_tokens >= len(ids) - 1 and 0 < after.catch_up_s <= after.draft_s


def test_one_slow_drafting_round_cannot_raise_d_several_fold():
    d = DraftCost(0.004)
    d.observe(4, 4 * 1.5)  # a round that waited 1.5 s per token on something else
    assert d.seconds_per_token <= 0.004 * (1 + 0.1 * (3.0 - 1)) + 1e-12
    for _ in range(40):
        d.observe(4, 4 * 0.012)  # the drafter really became 3x slower: d follows
    assert abs(d.seconds_per_token - 0.012) < 0.001


def test_a_drafter_cost_kept_from_an_earlier_process_is_timed_again_and_the_verify_costs_are_not(tmp_path):
    """A d kept too high (drafting slowed by a trainer on the same cores) would keep the drafter from
    ever drafting, and so from ever lowering it: each process times d again at its first request."""
    d_model, target, bridge = tiny_pair()
    path = tmp_path / "pair.json"
    kept = measured_policy(VerifyCosts.flat(0.150), drafter_s=5.0)
    kept.keep_at(path)
    kept.save()
    decoder = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)
    decoder.cost_policy.keep_at(path)
    assert decoder.cost_policy.draft_cost.seconds_per_token == 5.0
    restored = decoder.cost_policy.verify_costs
    prompt = target.tokenizer.encode("the cat sat on")
    config = DecodeConfig(max_new_tokens=8)
    first = decoder.generate(prompt, config)
    assert first.stats.measure_s > 0 and decoder.cost_policy.draft_cost.seconds_per_token < 1.0
    assert decoder.cost_policy.verify_costs is restored  # V is not timed again (that builds a new table)
    assert first.token_ids == SpeculativeDecoder(target).generate(prompt, config).token_ids
    assert decoder.generate(prompt, config).stats.measure_s == 0  # once per process


def test_a_drafter_cost_that_rose_while_the_drafter_sat_out_returns_to_its_timing():
    """d is observed only while drafting: a d raised by a busy spell (a trainer on the same cores)
    would keep the policy from drafting, and from observing d again, for the rest of the process.
    Steps the drafter sits out bring it back toward what this process timed, never below it."""
    d_model, target, bridge = tiny_pair()
    decoder = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)
    prompt = target.tokenizer.encode("the cat sat on")
    decoder.generate(prompt, DecodeConfig(max_new_tokens=4))  # times V and d
    b = decoder.cost_policy
    timed, timed_read = b._timed
    assert timed > 0 and timed_read > 0
    b.draft_cost, b.read_cost = DraftCost(50 * timed), DraftCost(50 * timed_read)  # a busy spell
    plain = plain_step(0.150, [1])
    for _ in range(300):
        b.learn(plain, reads_prompt=False)
    assert timed <= b.draft_cost.seconds_per_token < 1.2 * timed  # back near the timing, not below it
    assert timed_read <= b.read_cost.seconds_per_token < 1.2 * timed_read
    fresh_cost = DraftCost(0.004)
    fresh_cost.relax(0.010, 0.5)
    assert fresh_cost.seconds_per_token == 0.004  # never raised


def test_the_adapter_slot_asks_the_trainer_once_per_request_not_between_steps(tmp_path):
    """A new version drops the drafter's KV cache; mid-request the re-read of the whole context cost
    more than the version won in the rest of the request. So the slot looks when a request starts
    (or when asked: ``refresh``), never between steps."""
    from omnidraft.adapter import store
    from omnidraft.adapter.slot import AdapterSlot

    d_model, target, bridge = tiny_pair()
    drafter = make_drafter(d_model, bridge, target)
    decoder = SpeculativeDecoder(target, drafter, bridge)
    slot = AdapterSlot(drafter, store.Identity("d", "t", "a"), tmp_path / "pair--x")

    class Trainer:  # publishes nothing; counts how often it is asked
        polls = 0

        def poll(self):
            self.polls += 1

    slot.source = Trainer()
    decoder.observers.append(slot)
    result = decoder.generate(target.tokenizer.encode("the cat sat on"), DecodeConfig(max_new_tokens=12))
    assert decoder.stats.steps > 1 and len(result.token_ids) > 1
    assert slot.source.polls == 1
    slot.refresh()
    assert slot.source.polls == 2


def test_a_draft_expected_to_win_less_than_the_minimum_gain_is_not_made():
    """A key never tried, at its even prior, where a drafted row costs most of a plain step
    (llama.cpp on a 2-core CPU: V(2) 81 ms against V(0) 47 ms) is expected to win about 1.6%: less
    than DRAFT_MIN_GAIN, so the step is plain; evidence that the key is usually right makes it draft."""
    costs = VerifyCosts({0: 0.047, 1: 0.070, 2: 0.081, 4: 0.110})
    b = measured_policy(costs, drafter_s=0.005)
    rates = expected_rates(0.5, 0.0, b._capped_verify(), 2)
    assert 1.0 < max(rates) / rates[0] < DRAFT_MIN_GAIN  # it would have drafted on the estimate alone
    assert b._plan(Offer("context-2", 2, prior=EVEN_PRIOR), True)[0] == 0
    for _ in range(8):
        observe_lookup(b, "context-2", 2, 2, costs(2))
    assert b._plan(Offer("context-2", 2, prior=EVEN_PRIOR), True)[0] > 0


def test_verify_costs_timed_in_a_slow_moment_do_not_keep_drafting_off():
    """The policy timed V while another process had the cores (every verify ~2.3x dear, measured
    this way on Qwen-0.5B on llama.cpp): a lookup whose copies the target keeps does not pay on that
    table once plain steps at the real speed lower V(0) alone, and since a verify that looks dear is
    never made, it used to stay off for the whole process and every later one (the home keeps V).
    The unobserved verifies follow the plain steps, so the lookup drafts again."""
    real = {0: 0.045, 1: 0.067, 2: 0.088, 3: 0.114, 4: 0.125, 6: 0.166, 8: 0.204}
    b = measured_policy(VerifyCosts({k: 2.3 * v for k, v in real.items()}), drafter_s=0.007)
    key, offer = "context-4", Offer("context-4", 8, prior=EVEN_PRIOR)
    b._plan(offer, True)
    for _ in range(10):
        observe_lookup(b, key, 4, 4, real[4] * 2.3)  # kept whole, in the slow moment
    assert b._plan(offer, True)[0] > 0
    for _ in range(100):  # plain steps at the real speed
        b.learn(plain_step(real[0]), reads_prompt=False)
    assert b.verify_costs(0) < 1.05 * real[0]
    assert b._plan(offer, True)[0] > 0
    assert b.verify_costs(2) == pytest.approx(b.verify_costs(0) * real[2] / real[0], rel=0.01)


def test_a_position_a_few_early_rejections_pushed_down_is_drafted_again_and_relearnt():
    """The stop rule weighs the next token by that position's a_i, which only drafts reaching it can
    correct: after five rejections at position 2, a drafter that is right wherever it is sure would
    draft one token at a time until the decay forgot them (~250 drafts). The policy's deepening drafts
    one token past the stop now and then, and the position is relearnt within a few dozen drafts."""
    import torch

    b = measured_policy(VerifyCosts({0: 0.067, 1: 0.070, 2: 0.074, 4: 0.078, 8: 0.101}), drafter_s=0.005)
    b.stats.tried[0], b.stats.accepted[0] = 20.0, 15.0
    b.stats.tried[1], b.stats.accepted[1] = 5.0, 0.0
    sure = torch.tensor([10.0, 0.0, 0.0])
    lengths = []
    for _ in range(64):
        stop = b.stop_rule(8, None)
        stop.start()
        n = 0
        while n < 8:
            n += 1
            if stop.stop_after(0, sure, None, torch.zeros(4), sure):
                break
        lengths.append(n)
        b.learn(step(DRAFTER, False, n, n, n, 0.005 * n, b.verify_costs(n)), reads_prompt=False)  # all kept
    assert lengths[:EXPLORE_EVERY - 1] == [1] * (EXPLORE_EVERY - 1)  # stuck at one token, as the evidence says
    assert max(lengths[EXPLORE_EVERY - 1:EXPLORE_EVERY + 1]) > 1  # then one draft goes past its stop
    assert lengths[-8:] == [8] * 8, lengths  # and, its outcomes learnt, drafts grow on their own


def test_a_deepened_token_that_is_rejected_makes_the_next_one_rarer_and_is_charged_to_its_budget():
    import torch

    b = measured_policy(VerifyCosts({0: 0.067, 1: 0.070, 2: 0.074, 4: 0.078, 8: 0.101}), drafter_s=0.005)
    b.stats.tried[0], b.stats.accepted[0] = 20.0, 15.0
    b.stats.tried[1], b.stats.accepted[1] = 30.0, 3.0  # position 2 is rarely kept, and that is well known
    sure = torch.tensor([10.0, 0.0, 0.0])
    deepened = []
    for i in range(EXPLORE_EVERY * 8):
        stop = b.stop_rule(8, None)
        stop.start()
        n = 1
        while not stop.stop_after(0, sure, None, torch.zeros(4), sure):
            n += 1
        if n > 1:
            deepened.append(i)
        b.learn(step(DRAFTER, False, n, n, 1, 0.005 * n, b.verify_costs(n)), reads_prompt=False)  # one kept
    gaps = [b - a for a, b in zip(deepened, deepened[1:])]
    assert deepened and all(g2 > g1 for g1, g2 in zip(gaps, gaps[1:])), deepened  # each loss doubles the gap
    assert 0 < b.deepening.lost <= EXPLORE_SHARE * b.deepening.steps + 0.2  # within its budget (one token's worth)


def test_the_first_token_waits_for_no_long_drafter_read_and_a_fixed_rule_still_drafts_it():
    """The step that reads the request's text emits its first token. Where the drafter would first read
    that text for longer than a quarter of a plain step (FIRST_READ_SHARE), the cost policy leaves the
    step to the target and the drafter drafts from the next step on; a short read (a chat turn whose
    history was read ahead) drafts at once, and a fixed stop rule drafts from the first step, as it
    says. The output is the target's every time."""
    from dataclasses import replace

    d_model, target, bridge = tiny_pair()
    prompt = target.tokenizer.encode("the cat sat on the mat and the dog")
    config = DecodeConfig(max_new_tokens=16, draft_len=4, lookup=False)
    expected = SpeculativeDecoder(target).generate(prompt, config).token_ids

    def sources_by_step(read_s: float | None, config: DecodeConfig = config) -> list[str | None]:
        decoder = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)
        if read_s is not None:
            policy = measured_policy(VerifyCosts.flat(0.150), drafter_s=0.001)
            policy.read_cost = DraftCost(read_s)
            decoder.cost_policy = holding_costs(policy)
        seen, plain_step_fn = [], decoder.step

        def step(*args, **kwargs):
            result = plain_step_fn(*args, **kwargs)
            seen.append(result.source)
            return result

        decoder.step = step
        assert decoder.generate(prompt, config).token_ids == expected
        return seen

    slow_read = sources_by_step(read_s=0.150 / 10)  # the prompt: 20 drafter tokens, read in two steps' time
    assert slow_read[0] is None and slow_read[1] == DRAFTER, slow_read
    assert sources_by_step(read_s=0.150 / 40)[0] is None  # half a step's read: the first token does not wait
    assert sources_by_step(read_s=0.150 / 1000)[0] == DRAFTER
    assert sources_by_step(None, replace(config, draft_stop="fixed"))[0] == DRAFTER


def test_a_free_lookup_may_draft_the_step_that_reads_the_prompt():
    d_model, target, bridge = tiny_pair()
    text = "the cat sat on the mat and the dog sat on the log"
    prompt = target.tokenizer.encode(text + " " + text + " " + text)[:-3]  # ends inside a repeat: a long match
    config = DecodeConfig(max_new_tokens=8, draft_len=4)
    decoder = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)
    decoder.cost_policy = holding_costs(measured_policy(VerifyCosts.flat(0.150), drafter_s=0.001))
    first = decoder.step
    sources = []
    decoder.step = lambda *a, **k: sources.append(first(*a, **k)) or sources[-1]
    assert decoder.generate(prompt, config).token_ids == SpeculativeDecoder(target).generate(prompt, config).token_ids
    assert sources[0].source == "context" and sources[0].proposed > 0, [s.source for s in sources]
