"""Draft sources are peers: a new way to draft is one class and one entry in ``SOURCES``, the decoder
asks it through the interface, counts its steps once and keeps the target's output (a toy target,
no model)."""

from __future__ import annotations

from test_history import PROMPT, ToyTarget

from omnidraft import decode
from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.sources import SOURCES, Offer, Parts, StepResult, StepTimes
from omnidraft.sources.policy import DRAFTER, CostPolicy, NoCostPolicy
from omnidraft.verify.proposal import Proposal


class Oracle:
    """A source that knows the toy target's next ids (every proposal is accepted) and costs time."""

    name, free = "oracle", False

    def __init__(self, parts: Parts) -> None:
        self.steps_seen = 0

    def begin(self, ids, config, policy) -> bool:
        return True

    def offer(self, ids, room: int) -> Offer:
        return Offer(self.name, min(3, room))

    def draft(self, ids, offer: Offer, k: int, times: StepTimes) -> Proposal:
        context = list(ids)
        for _ in range(k):
            context.append(ToyTarget.next_id(context))
        return Proposal(context[len(ids):])

    def accept(self, step: StepResult) -> None:
        self.steps_seen += 1

    def finish(self, prompt_len: int, ids: list[int]) -> None:
        pass


def run(decoder: SpeculativeDecoder, n: int = 20) -> list[int]:
    config = DecodeConfig(max_new_tokens=n, draft_stop="fixed")
    return [t for chunk in decoder.stream_ids(PROMPT, config) for t in chunk]


def test_a_new_source_is_one_class_and_one_registration(monkeypatch):
    expected = run(SpeculativeDecoder(ToyTarget()))
    monkeypatch.setattr(decode, "SOURCES", SOURCES + (Oracle,))
    target = ToyTarget()
    decoder = SpeculativeDecoder(target)
    oracle = decoder.source("oracle")
    assert [s.name for s in decoder.sources] == ["oracle"]  # no drafter, no lookup: only the new source
    assert run(decoder) == expected  # verified like any draft: the output is the target's
    s = decoder.stats
    assert s.steps == target.forwards == s.target_forwards == 5  # 4 proposals per forward: 3 drafted + the target's own
    assert s.proposed_tokens == s.accepted_tokens == s.drafted_tokens == 15 and s.plain_steps == 0
    assert oracle.steps_seen == s.steps  # every source sees every step (the context sync)


def test_the_cost_policy_learns_each_source_apart(monkeypatch):
    monkeypatch.setattr(decode, "SOURCES", SOURCES + (Oracle,))
    decoder = SpeculativeDecoder(ToyTarget())
    policy = decoder.cost_policy
    # Costs are taken only from a state measured on the same machine; without that the policy would
    # measure the toy target and the oracle afresh, and on a loaded host their microseconds decide.
    assert policy.restore({"format": 2, "machine": policy.machine,
                           "verify_s": {"0": 0.1, "1": 0.1, "8": 0.1}, "draft_s": 0.001,
                           "stats": {"tried": [0.0] * 16, "accepted": [0.0] * 16},
                           "calibration": {"tried": [4.0] * 10, "accepted": [(b + 0.5) * 0.4 for b in range(10)]}})
    assert policy.verify_costs is not None and policy.verify_costs.table[1] == 0.1  # restored, not measured again
    config = DecodeConfig(max_new_tokens=20)  # draft_stop auto: the cost policy decides
    assert [t for chunk in decoder.stream_ids(PROMPT, config) for t in chunk] == run(SpeculativeDecoder(ToyTarget()))
    learned = policy.acceptance_for("oracle")
    assert learned.steps > 0 and learned.rate(1) > 0.5  # its proposals were all accepted
    assert policy.acceptance_for(DRAFTER).steps == 0  # the model drafter's statistics are its own


def test_free_sources_are_asked_first_in_listed_order():
    class Named:
        def __init__(self, name: str, free: bool) -> None:
            self.name, self.free = name, free

    sources = [Named("drafter", False), Named("context", True), Named("history", True)]
    for policy in (NoCostPolicy(), CostPolicy()):
        assert [s.name for s in policy.order(sources)] == ["context", "history", "drafter"]
