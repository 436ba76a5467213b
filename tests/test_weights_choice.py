"""The weights choice: per request the cost policy runs the drafter's adapter or its base weights,
whichever its evidence expects to draft faster, and now and then the others (tiny random models and
synthetic costs; the real pair in tests/test_online.py)."""

from __future__ import annotations

import copy

import pytest

from tiny import tiny_pair

from omnidraft.adapter.store import BASE_WEIGHTS
from omnidraft.config import DecodeConfig
from omnidraft.costs import DraftCost, VerifyCosts
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import make_drafter
from omnidraft.verify.proposal import Proposal
from omnidraft.sources.base import StepResult, StepTimes
from omnidraft.sources.policy import DRAFTER, KEEP_ON_NEW_WEIGHTS, WEIGHTS_GAP_MAX, WEIGHTS_GAP_MIN, CostPolicy, WeightsChoice

CPU_COSTS = {0: 0.050, 1: 0.056, 2: 0.060, 4: 0.068, 8: 0.090}  # a target whose verifies grow slowly
V1, V2 = "adapters/pair/v000001", "adapters/pair/v000002"


class Switch:
    """What the policy switches (the adapter slot's two methods), recording what each request ran."""

    def __init__(self, policy: CostPolicy, adapter: str | None) -> None:
        self.policy, self.adapter_weights, self.running = policy, adapter, adapter or BASE_WEIGHTS
        self.ran: list[str] = []

    def run(self, weights: str) -> None:
        self.running = weights
        self.policy.drafter_weights(weights)


def policy_with(adapter: str | None = V1) -> tuple[CostPolicy, Switch]:
    b = CostPolicy()
    b.verify_costs, b.draft_cost = VerifyCosts(CPU_COSTS), DraftCost(0.006)
    switch = Switch(b, adapter)
    b.switch = switch
    b.drafter_weights(switch.running)
    return b, switch


def serve(b: CostPolicy, switch: Switch, requests: int, drafters: dict[str, tuple[float, float]]) -> list[str]:
    """``requests`` requests, each 20 drafts of 4 by the weights the policy picked, which cost and
    accept as ``drafters[weights]`` says: (seconds per drafted token, share of drafts fully kept)."""
    ran = []
    for _ in range(requests):
        b.prepare()
        weights = switch.running
        ran.append(weights)
        d, kept_share = drafters["base" if weights == BASE_WEIGHTS else "adapter"]
        for i in range(20):
            b.draft_cost.observe(4, 4 * d)
            b.stats.update(4, 4 if (i % 20) < kept_share * 20 else 0)
    return ran


def test_the_base_weights_run_where_the_adapter_accepts_no_more_and_costs_more_per_token():
    """An adapter trained on other domains: the same acceptance here, its LoRA branches make each
    drafted token dearer. After one request each, the base weights run; the adapter runs again
    once per gap, and the gap doubles each time it confirms the choice."""
    b, switch = policy_with()
    ran = serve(b, switch, 40, {"adapter": (0.0085, 0.5), "base": (0.0060, 0.5)})
    assert ran[0] == V1 and ran[1] == BASE_WEIGHTS  # the adapter's news first, then the base weights once
    again = [i for i, w in enumerate(ran) if w == V1 and i > 0]
    assert again and all(b - a > WEIGHTS_GAP_MIN for a, b in zip(again, again[1:]))
    gaps = [b - a for a, b in zip(again, again[1:])]
    assert gaps == sorted(gaps) and ran.count(BASE_WEIGHTS) >= 34
    assert b.weights_choice.picks == {"adapter": ran.count(V1), "base": ran.count(BASE_WEIGHTS)}


def test_the_adapter_runs_where_it_accepts_enough_more_to_pay_for_its_cost():
    b, switch = policy_with()
    ran = serve(b, switch, 40, {"adapter": (0.0085, 0.8), "base": (0.0060, 0.3)})
    assert ran[1] == BASE_WEIGHTS and ran.count(V1) >= 34
    assert b.weights_value(V1) > b.weights_value(BASE_WEIGHTS)


def test_a_change_of_domain_is_followed_within_a_gap():
    """The user moves to text the adapter learnt: its next turn on the adapter shows it, and from the
    request after that the adapter is the choice, the base weights running once per gap."""
    b, switch = policy_with()
    serve(b, switch, 12, {"adapter": (0.0085, 0.3), "base": (0.0060, 0.3)})
    assert switch.running == BASE_WEIGHTS
    ran = serve(b, switch, 3 * WEIGHTS_GAP_MAX, {"adapter": (0.0085, 0.9), "base": (0.0060, 0.3)})
    first = ran.index(V1)
    after = ran[first + 1:]
    assert first <= WEIGHTS_GAP_MAX and after[0] == V1 and after.count(BASE_WEIGHTS) <= len(after) // WEIGHTS_GAP_MIN


def test_switching_back_brings_back_each_weights_own_evidence_and_a_new_version_inherits_a_share():
    b, switch = policy_with()
    b.stats.update(4, 4)
    adapter_tried, adapter_d = list(b.stats.tried), b.draft_cost.seconds_per_token
    switch.run(BASE_WEIGHTS)
    b.draft_cost.observe(4, 4 * 0.002)
    for _ in range(5):
        b.stats.update(4, 0)
    base_tried, base_d = list(b.stats.tried), b.draft_cost.seconds_per_token
    switch.run(V1)
    assert b.stats.tried == adapter_tried and b.draft_cost.seconds_per_token == adapter_d  # not discounted
    b.drafter_weights(V2)  # the trainer's next version: a share of v1's evidence, none of the base's
    assert b.stats.tried == pytest.approx([t * KEEP_ON_NEW_WEIGHTS for t in adapter_tried])
    assert set(b.shelf) == {BASE_WEIGHTS}  # v1 will not run again
    b.drafter_weights(BASE_WEIGHTS)
    assert b.stats.tried == base_tried and b.draft_cost.seconds_per_token == base_d
    assert b.weights_value(V2) is None  # inherited numbers are not evidence: v2 runs at the next request
    assert WeightsChoice().pick({V2: None, BASE_WEIGHTS: 2.0}, V2) == V2


def test_the_evidence_of_both_weights_and_the_schedule_are_kept_with_the_policy(tmp_path):
    b, switch = policy_with()
    serve(b, switch, 8, {"adapter": (0.0085, 0.5), "base": (0.0060, 0.5)})
    b.keep_at(tmp_path / "pair.json")
    b.save()
    again = CostPolicy()
    again.keep_at(tmp_path / "pair.json")
    assert again.weights == b.weights and set(again.shelf) == set(b.shelf)
    for key in (V1, BASE_WEIGHTS):
        assert again.weights_value(key) == pytest.approx(b.weights_value(key))
    assert again.weights_choice.state() == b.weights_choice.state()
    moved = CostPolicy()  # another machine: acceptance kept, the shelved weights' costs measured again
    moved.keep_at(tmp_path / "pair.json", machine="another cpu")
    (shelved,) = moved.shelf.values()
    assert not shelved.draft_cost.known and shelved.stats.tried == next(iter(b.shelf.values())).stats.tried


@pytest.mark.parametrize("entry", [None, "x", {"stats": {"tried": [1.0], "accepted": [2.0]}},
                                   {"stats": {"tried": [1.0] * 16, "accepted": [2.0] * 16},
                                    "calibration": {"tried": [1.0] * 10, "accepted": [0.0] * 10}},
                                   {"stats": {"tried": [1.0] * 16, "accepted": [0.0] * 16},
                                    "calibration": {"tried": [1.0] * 10, "accepted": [0.0] * 10}, "requests": -1}])
def test_a_damaged_shelf_entry_is_left_out_and_the_rest_restored(tmp_path, entry):
    import json

    b, switch = policy_with()
    serve(b, switch, 3, {"adapter": (0.0085, 0.5), "base": (0.0060, 0.5)})
    b.keep_at(tmp_path / "pair.json")
    b.save()
    state = json.loads((tmp_path / "pair.json").read_text())
    state["shelf"]["adapters/other"] = entry
    state["weights_choice"] = [WEIGHTS_GAP_MAX * 2, 0]  # out of range: a fresh schedule
    (tmp_path / "pair.json").write_text(json.dumps(state))
    again = CostPolicy()
    again.keep_at(tmp_path / "pair.json")
    assert again.measured and set(again.shelf) == set(b.shelf)
    assert again.weights_choice.gap == WEIGHTS_GAP_MIN


def test_the_slot_runs_the_base_weights_with_the_adapter_kept_and_the_cache_kept(tmp_path):
    """The switch itself on a tiny drafter: base logits, then the adapter's again; the KV cache kept;
    the acceptance head only with the adapter; the output the target's with either."""
    import torch

    from omnidraft.adapter import store
    from omnidraft.adapter.head import AcceptHead
    from omnidraft.adapter.slot import AdapterSlot
    from omnidraft.train.publish import save as publish

    from test_adapter_store import IDENTITY, _peft

    d_model, target, bridge = tiny_pair()
    drafter = make_drafter(d_model, bridge, target)
    ids = [3, 4, 5, 6]
    base_logits = drafter.lm.logits_for(ids).clone()
    drafter.reset()
    head = AcceptHead(drafter.lm.hidden_size)
    path = publish(tmp_path / "pair", _peft(), {"identity": vars(IDENTITY)}, head_state=head.state_dict())
    slot = AdapterSlot(drafter, IDENTITY, tmp_path / "pair")
    told: list[str] = []
    slot.listeners.append(told.append)
    slot.use(store.load(path, IDENTITY))
    adapter_logits = drafter.lm.logits_for(ids).clone()
    assert not torch.allclose(adapter_logits, base_logits) and drafter.head is not None
    slot.run(BASE_WEIGHTS)
    assert drafter.lm.cached_ids == ids and drafter.head is None and slot.current is not None
    assert slot.weights == BASE_WEIGHTS and slot.adapter_weights == str(path) and "base weights" in slot.description
    drafter.reset()
    assert torch.allclose(drafter.lm.logits_for(ids), base_logits, atol=1e-5)
    slot.run(slot.adapter_weights)
    drafter.reset()
    assert torch.allclose(drafter.lm.logits_for(ids), adapter_logits, atol=1e-5) and drafter.head is not None
    assert told == [str(path), BASE_WEIGHTS, str(path)]
    with pytest.raises(ValueError, match="no weights"):
        slot.run("adapters/elsewhere")

    decoder = SpeculativeDecoder(target, drafter, bridge)
    slot.listeners.append(decoder.cost_policy.drafter_weights)
    decoder.cost_policy.drafter_weights(slot.weights)
    decoder.cost_policy.switch = slot
    decoder.observers.append(slot)
    prompt = target.tokenizer.encode("the cat sat on")
    alone = SpeculativeDecoder(target).generate(prompt, DecodeConfig(max_new_tokens=12, lookup=False)).token_ids
    ran, heads = [], []
    for _ in range(3):
        out = decoder.generate(prompt, DecodeConfig(max_new_tokens=12))
        ran.append(slot.weights)
        heads.append(decoder.cost_policy._stop.head)  # what the request's stop rule read its estimates from
        assert out.token_ids == alone
    assert ran[:2] == [str(path), BASE_WEIGHTS]  # the adapter first, the base weights once next
    assert heads[0] is slot._head and heads[1] is None  # each request's drafts stop by its own weights' head
    assert decoder.cost_policy.stats is decoder.cost_policy.acceptance[DRAFTER]
    twin = copy.deepcopy(decoder.cost_policy)  # what the demo's timing reruns decide on
    assert twin.switch is slot and twin.stats is not decoder.cost_policy.stats
    assert twin.state() == decoder.cost_policy.state() and twin.measured  # the same evidence, costs and schedule


class AlternatingSwitch(Switch):
    """A switch that is a swap (the native drafter's): the policy may alternate weights draft by draft."""

    alternates = True


def drafted_step(kept: int, d: float = 0.006, verify_s: float = 0.068) -> StepResult:
    """A draft of 4 by the model drafter, ``kept`` of them accepted."""
    return StepResult("drafter", DRAFTER, False, Proposal([1, 2, 3, 4]), 4, kept, [0] * (kept + 1), False, None,
                      StepTimes(draft_s=4 * d, verify_s=verify_s), kept=kept)


# texts that alternate hard and easy; on each the adapter keeps 0.2 more of its drafts than the base weights
HARD_EASY = {"adapter": {"hard": 0.4, "easy": 0.9}, "base": {"hard": 0.2, "easy": 0.7}}


def serve_texts(b: CostPolicy, switch: Switch, texts: list[str], shares: dict = HARD_EASY) -> list[str]:
    """Each request (one per text) makes 20 drafts of 4 through ``learn``, each kept whole or not at
    all as ``shares[weights][text]`` says, by the weights running at that draft. Returns what each
    request ran: a weights key, or "paired" for a paired trial."""
    ran = []
    for text in texts:
        b.prepare()
        ran.append("paired" if b.weights_choice.pairing else switch.running)
        for i in range(20):
            share = shares["base" if switch.running == BASE_WEIGHTS else "adapter"][text]
            b.learn(drafted_step(4 if (i % 10) < share * 10 else 0), reads_prompt=False)
    return ran


def test_paired_trials_pick_the_adapter_that_is_better_on_every_text_where_whole_requests_do_not():
    """The base weights' one request falls on an easy text and the adapter's on hard ones: compared
    request by request the base weights look faster and run on most requests. Alternating the two
    draft by draft on the same text, the adapter wins its first trial and runs from the next request
    on (request by request, the base weights ran 13 of the first 15); the base weights
    draft only inside the later trials, each of which confirms the choice and doubles the gap."""
    texts = ["hard", "easy"] * 20
    b, switch = policy_with()
    unpaired = serve_texts(b, switch, texts)
    assert unpaired[:2] == [V1, BASE_WEIGHTS] and unpaired[:15].count(BASE_WEIGHTS) >= 10  # the confound
    b, switch = policy_with()
    switch.__class__ = AlternatingSwitch
    ran = serve_texts(b, switch, texts)
    assert ran[0] == "paired" and ran[1] == V1 and BASE_WEIGHTS not in ran
    assert ran.count(V1) >= 32 and b.weights_choice.preferred == V1
    assert b.weights_choice.trials.winner() == V1 and b.weights_choice.gap > WEIGHTS_GAP_MIN
    trials = [i for i, w in enumerate(ran) if w == "paired"]
    assert all(b2 - a2 >= b1 - a1 for (a1, b1), (a2, b2) in zip(zip(trials, trials[1:]), zip(trials[1:], trials[2:])))
    assert b.weights_choice.picks == {"adapter": ran.count(V1), "base": 0, "paired": len(trials)}
    ratio = b.weights_choice.trials.ratio()
    assert ratio > 1.1 and f"{ratio:.2f}x" in b.weights_choice.summary() and "the adapter runs" in b.weights_choice.summary()
    assert WeightsChoice().summary() is None


def test_paired_trials_follow_the_base_weights_where_the_adapter_stops_paying():
    """The adapter's LoRA branches make its drafts dearer: where it accepts no more than the base
    weights, the paired trial picks them; a new adapter version is tried afresh."""
    b, switch = policy_with()
    switch.__class__ = AlternatingSwitch
    even = {"adapter": {"text": 0.5}, "base": {"text": 0.5}}
    for _ in range(1 + WEIGHTS_GAP_MIN):  # a trial, then a gap of requests on its winner
        b.prepare()
        for i in range(20):
            adapter = switch.running != BASE_WEIGHTS
            kept = 4 if (i // 2) % 2 == 0 else 0  # each weights keeps half of its drafts, alternating in turn
            b.learn(drafted_step(kept, d=0.0085 if adapter else 0.006), reads_prompt=False)
    assert b.weights_choice.preferred == BASE_WEIGHTS and switch.running == BASE_WEIGHTS
    switch.adapter_weights = V2  # the trainer's next version
    assert serve_texts(b, switch, ["text"], even) == ["paired"] and b.weights_choice.trials.adapter == V2


def test_paired_trials_are_kept_with_the_policy_and_a_damaged_record_starts_them_again(tmp_path):
    import json

    b, switch = policy_with()
    switch.__class__ = AlternatingSwitch
    serve_texts(b, switch, ["hard", "easy"] * 3)
    b.keep_at(tmp_path / "pair.json")
    b.save()
    again = CostPolicy()
    again.keep_at(tmp_path / "pair.json")
    assert again.weights_choice.trials == b.weights_choice.trials and again.weights_choice.preferred == V1
    state = json.loads((tmp_path / "pair.json").read_text())
    state["weights_trials"]["preferred"] = None  # saved before a trial's verdict was read
    (tmp_path / "pair.json").write_text(json.dumps(state))
    unread, switch = policy_with()
    switch.__class__ = AlternatingSwitch
    unread.keep_at(tmp_path / "pair.json")
    unread.prepare()  # the kept tally decides at once
    assert switch.running == V1 and not unread.weights_choice.pairing and unread.weights_choice.preferred == V1
    state["weights_trials"]["tally"][V1] = [1.0, -2.0, 3.0]
    (tmp_path / "pair.json").write_text(json.dumps(state))
    damaged = CostPolicy()
    damaged.keep_at(tmp_path / "pair.json")
    assert damaged.measured and damaged.weights_choice.trials is None and damaged.weights_choice.preferred is None


def test_a_paired_trial_switches_the_weights_between_drafts_and_keeps_the_targets_output(tmp_path):
    """On a drafter whose switch is a swap, a trial request alternates the adapter and the base
    weights after every draft, keeping the drafter's cache; each draft stops by the head of the
    weights drafting it (the adapter's head, none for the base weights); every request's output is
    the target's."""
    from omnidraft.adapter import store
    from omnidraft.adapter.head import AcceptHead
    from omnidraft.adapter.slot import AdapterSlot
    from omnidraft.train.publish import save as publish

    from test_adapter_store import IDENTITY, _peft
    from tiny import holding_costs

    d_model, target, bridge = tiny_pair()
    drafter = make_drafter(d_model, bridge, target)
    drafter.lm.cheap_adapter_switch = True  # a merge on torch: correct, only dearer than the native swap
    path = publish(tmp_path / "pair", _peft(), {"identity": vars(IDENTITY)},
                   head_state=AcceptHead(drafter.lm.hidden_size).state_dict())
    slot = AdapterSlot(drafter, IDENTITY, tmp_path / "pair")
    slot.use(store.load(path, IDENTITY))
    assert slot.alternates and slot._head is not None
    head_calls = []
    estimate = slot._head.accept_prob

    def adapter_head(hidden, logits):  # the adapter's head, read only while the adapter drafts
        head_calls.append(slot.weights)
        return estimate(hidden, logits)

    slot._head.accept_prob = adapter_head
    decoder = SpeculativeDecoder(target, drafter, bridge)
    policy = decoder.cost_policy
    told: list[str] = []
    slot.listeners += [policy.drafter_weights, told.append]
    policy.drafter_weights(slot.weights)
    policy.switch = slot
    decoder.observers.append(slot)
    policy.verify_costs, policy.draft_cost, policy.read_cost = VerifyCosts(CPU_COSTS), DraftCost(0.0005), DraftCost(0.0001)
    holding_costs(policy)  # drafting pays at these costs whatever this host's speed
    prompt = target.tokenizer.encode("the cat sat on")
    alone = SpeculativeDecoder(target).generate(prompt, DecodeConfig(max_new_tokens=24, lookup=False)).token_ids
    for _ in range(2):
        assert decoder.generate(prompt, DecodeConfig(max_new_tokens=24, lookup=False)).token_ids == alone
    trials = policy.weights_choice.trials
    drafts = {w: e[2] for w, e in trials.tally.items()}
    assert set(drafts) == {str(path), BASE_WEIGHTS} and sum(drafts.values()) >= 4, drafts
    assert told.count(BASE_WEIGHTS) >= 2 and abs(drafts[str(path)] - drafts[BASE_WEIGHTS]) <= 2  # in turn
    assert head_calls and set(head_calls) == {str(path)}
    # chat's /stats (and banner) adapter line says what the trials found
    from types import SimpleNamespace

    from omnidraft.chat.session import ChatSession

    line = ChatSession.adapter_description(SimpleNamespace(pipe=SimpleNamespace(adapter_slot=slot, decoder=decoder),
                                                           learner=None, train=False))
    ratio = trials.ratio()
    assert ratio is not None and f"paired trials: the adapter drafts at {ratio:.2f}x" in line, line
    assert line.startswith(slot.description) and line.endswith("· not training (--no-train)")
    slot.run(BASE_WEIGHTS)  # where a trial ended on the base weights, the slot claims no verdict of its own
    assert slot.on_base and "draft faster" not in slot.description


def test_without_an_adapter_nothing_is_switched():
    b, switch = policy_with(adapter=None)
    serve(b, switch, 3, {"adapter": (0.0085, 0.5), "base": (0.0060, 0.5)})
    assert b.weights_choice.picks == {"adapter": 0, "base": 0} and b.shelf == {}


def test_a_version_published_before_a_request_plans_it_under_every_stop_rule(tmp_path):
    """The trainer's newest version is taken when a request starts, before its sources plan: a
    request under a fixed stop rule (``--draft-stop head``) drafts with the head of the version
    published just before it, not the previous one's (here: none, which that rule refuses). And a
    request that fails while planning still ends for its observers (the trainer is told to go on)."""
    from omnidraft.adapter.head import AcceptHead
    from omnidraft.adapter.slot import AdapterSlot
    from omnidraft.errors import OmnidraftError
    from omnidraft.observer import DecodeObserver
    from omnidraft.train.publish import save as publish

    from test_adapter_store import IDENTITY, _peft

    d_model, target, bridge = tiny_pair()
    drafter = make_drafter(d_model, bridge, target)
    decoder = SpeculativeDecoder(target, drafter, bridge)
    slot = AdapterSlot(drafter, IDENTITY, tmp_path / "pair")
    decoder.observers.append(slot)

    class Ends(DecodeObserver):
        started = finished = 0

        def on_start(self, prompt_ids):
            self.started += 1

        def on_finish(self):
            self.finished += 1

    ends = Ends()
    decoder.observers.append(ends)
    prompt = target.tokenizer.encode("the cat sat on")
    config = DecodeConfig(max_new_tokens=12, draft_stop="head", lookup=False)
    with pytest.raises(OmnidraftError, match="acceptance head"):  # no adapter yet: nothing to stop by
        decoder.generate(prompt, config)
    assert (ends.started, ends.finished) == (1, 1)

    path = publish(tmp_path / "pair", _peft(), {"identity": vars(IDENTITY)},
                   head_state=AcceptHead(drafter.lm.hidden_size).state_dict())

    class Trainer:  # published one version since the last look
        def __init__(self):
            self.queue = [type("Published", (), {"path": path})()]

        def poll(self):
            return self.queue.pop() if self.queue else None

    slot.source = Trainer()
    alone = SpeculativeDecoder(target).generate(prompt, DecodeConfig(max_new_tokens=12, lookup=False)).token_ids
    out = decoder.generate(prompt, config)
    assert out.token_ids == alone and slot.adapter_weights == str(path)
    assert decoder.stats.drafted_tokens > 0  # it drafted, stopping by the new version's head
    assert (ends.started, ends.finished) == (2, 2)
