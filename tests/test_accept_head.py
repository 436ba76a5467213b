"""The acceptance head (§3.3): its loss and stopping rule against hand-computed values, its file
format, and its grip on drafting (tiny random models)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from tiny import holding_costs, tiny_model, tiny_pair

from omnidraft.adapter import head as accept_head
from omnidraft.adapter import store as adapter_store
from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.errors import OmnidraftError
from omnidraft.runtime import make_drafter
from omnidraft.train.accept_head import state_of, weighted_bce
from omnidraft.train.distill import _auc
from omnidraft.train.publish import save as publish


def test_weighted_bce_matches_hand_computed_values():
    logit, label = torch.tensor([0.0, 2.0, -1.0]), torch.tensor([1.0, 0.0, 0.25])
    # z=0, l=1: log 2;  z=2, l=0: log(1 + e^2), weighted 3;  soft l=0.25 at z=-1: its BCE,
    # −[0.25·log σ(−1) + 0.75·log σ(1)], weighted 0.25 + 3·0.75.
    soft = -(0.25 * math.log(1 / (1 + math.e)) + 0.75 * math.log(1 / (1 + math.exp(-1))))
    expected = math.log(2) + 3 * math.log(1 + math.e ** 2) + (0.25 + 3 * 0.75) * soft
    assert float(weighted_bce(logit, label, reject_weight=3.0)) == pytest.approx(expected, rel=1e-5)
    plain = math.log(2) + math.log(1 + math.e ** 2) + soft
    assert float(weighted_bce(logit, label)) == pytest.approx(plain, rel=1e-5)


def test_stop_rule_is_eq_6_and_7():
    assert not accept_head.should_stop([0.9], 0.2)  # P(reject) = 0.1
    assert not accept_head.should_stop([0.9, 0.8], 0.3)  # 1 − 0.72 = 0.28
    assert accept_head.should_stop([0.9, 0.8], 0.25)
    assert accept_head.should_stop([0.9, 0.8, 0.9], 0.3)  # 1 − 0.648 = 0.352


def test_features_hold_hidden_state_logit_of_top_prob_and_entropy():
    hidden = torch.randn(3, 5)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3), 0.0, -1e9, -1e9], [1e9, 0.0, 0.0, 0.0]])
    f = accept_head.features(hidden, logits)
    assert f.shape == (3, 5 + accept_head.CONFIDENCE_FEATURES)
    assert torch.equal(f[:, :5], hidden)
    assert f[0, 5] == pytest.approx(math.log(0.25 / 0.75)) and f[0, 6] == pytest.approx(math.log(4))  # uniform
    assert f[1, 5] == pytest.approx(math.log(3), rel=1e-4)  # max q = 3/4: logit = log 3
    assert torch.isfinite(f[2]).all() and f[2, 5] > 10 and f[2, 6] < 1e-6  # one-hot stays finite


def test_untrained_head_is_the_confidence_rule():
    """It starts at P(accept) = max q, whatever the hidden state."""
    head = accept_head.AcceptHead(6, width=4)
    logits = torch.tensor([math.log(3), 0.0, -1e9])
    for _ in range(3):
        assert head.accept_prob(torch.randn(6) * 50, logits) == pytest.approx(0.75, rel=1e-4)


def test_the_one_row_path_is_the_modules_forward():
    """``accept_prob`` computes the features and layers in fewer passes (it runs per drafted token):
    the same number as the module's forward on ``features``, for a trained-looking head."""
    torch.manual_seed(0)
    head = accept_head.AcceptHead(16, width=8)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5)
    for scale in (0.1, 3.0, 40.0):  # flat, peaked, one-hot-like drafter distributions
        for _ in range(4):
            hidden, logits = torch.randn(16) * 4, torch.randn(300) * scale
            expected = float(torch.sigmoid(head(accept_head.features(hidden[None], logits[None])))[0])
            assert head.accept_prob(hidden, logits) == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_auc_by_ranks():
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert _auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), labels) == 1.0
    assert _auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), labels) == 0.0
    assert _auc(torch.tensor([0.1, 0.8, 0.2, 0.9]), labels) == 0.75
    assert _auc(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 1.0])) == 0.5  # one class: no information


def test_head_state_round_trips_and_refuses_another_width():
    head = accept_head.AcceptHead(8, width=4)
    again = accept_head.from_state(state_of(head), 8)
    x = torch.randn(3, 8 + accept_head.CONFIDENCE_FEATURES)
    assert torch.equal(head(x), again(x))
    with pytest.raises(ValueError, match="does not fit"):
        accept_head.from_state(state_of(head), 16)
    broken = state_of(head)
    broken["mlp.2.bias"] = torch.tensor([float("nan")])
    with pytest.raises(ValueError, match="non-finite"):
        accept_head.from_state(broken, 8)


def test_adapter_store_keeps_the_head_and_flags_a_corrupt_one(tmp_path):
    from peft import get_peft_model

    from omnidraft.train.lora import lora_config

    model = get_peft_model(tiny_model(300, seed=0), lora_config(rank=4, alpha=4))
    head = accept_head.AcceptHead(int(model.get_base_model().config.hidden_size), width=4)
    path = publish(tmp_path / "pair", model, {"identity": {}}, state_of(head))
    loaded = adapter_store.load(tmp_path / "pair", None)
    assert loaded.head_state is not None and torch.equal(loaded.head_state["mlp.0.weight"], head.mlp[0].weight)
    (path / adapter_store.HEAD_FILE).write_bytes(b"not safetensors")
    with pytest.raises(adapter_store.AdapterProblem, match="corrupt acceptance head"):
        adapter_store.load(tmp_path / "pair", None)
    publish(tmp_path / "bare", model, {"identity": {}})
    assert adapter_store.load(tmp_path / "bare", None).head_state is None  # an adapter without a head


@pytest.fixture(scope="module")
def decoder():
    d_model, target, bridge = tiny_pair()
    return SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)


def _head_always(decoder: SpeculativeDecoder, logit: float) -> accept_head.AcceptHead:
    """A head that predicts sigmoid(logit) for every token."""
    head = accept_head.AcceptHead(decoder.drafter.lm.hidden_size, width=4)
    with torch.no_grad():
        head.confidence.weight.zero_()
        head.confidence.bias.fill_(logit)
    return head


def _drafted_per_step(decoder: SpeculativeDecoder, config: DecodeConfig) -> tuple[float, list[int]]:
    out = decoder.generate(decoder.target.tokenizer.encode("the cat sat on"), config)
    s = decoder.stats
    return s.drafted_tokens / max(s.steps, 1), out.token_ids


def test_head_decides_the_draft_length_and_never_the_output(decoder):
    cfg = DecodeConfig(max_new_tokens=24, draft_len=6, draft_stop="head", stop_gamma=0.5)
    expected = SpeculativeDecoder(decoder.target).generate(decoder.target.tokenizer.encode("the cat sat on"), cfg).token_ids
    try:
        decoder.drafter.head = _head_always(decoder, 6.0)  # P(accept) ≈ 0.998: never stops early
        long, out_long = _drafted_per_step(decoder, cfg)
        decoder.drafter.head = _head_always(decoder, -6.0)  # P(accept) ≈ 0.002: stops after one token
        short, out_short = _drafted_per_step(decoder, cfg)
        decoder.drafter.head = _head_always(decoder, math.log(9))  # P = 0.9: 1 − 0.9^n > 0.3 at n = 4
        four, _ = _drafted_per_step(decoder, DecodeConfig(max_new_tokens=24, draft_len=6, draft_stop="head", stop_gamma=0.3))
        fixed, _ = _drafted_per_step(decoder, DecodeConfig(max_new_tokens=24, draft_len=6, draft_stop="fixed"))
    finally:
        decoder.drafter.head = None
    assert 0.9 < short <= 1.0  # one token per draft (the last step may be a plain target step)
    assert 5.0 < long <= 6.0 and fixed == pytest.approx(long)  # a confident head drafts like fixed k
    assert 3.0 < four <= 4.0
    assert out_long == out_short == expected  # greedy output is the target's whatever the draft length


def test_use_head_false_drafts_as_if_the_adapter_had_no_head(decoder):
    """The bench's greedy-nohead mode: the cost-aware stop rule reads the calibrated max q instead of
    the head, on the same drafter and adapter."""
    from omnidraft.costs import DraftCost, VerifyCosts
    from omnidraft.sources.policy import CostPolicy

    def cheap_drafting() -> CostPolicy:  # a verify costs one step whatever its length, a drafted token ~nothing
        policy = CostPolicy()
        policy.verify_costs, policy.draft_cost = VerifyCosts.flat(0.150), DraftCost(0.0001)
        return holding_costs(policy)

    cfg = DecodeConfig(max_new_tokens=24, draft_len=6, lookup=False)
    kept = decoder.cost_policy
    try:
        decoder.drafter.head = _head_always(decoder, 6.0)  # P(accept) ≈ 0.998: every draft as long as allowed
        decoder.cost_policy = cheap_drafting()
        with_head, out = _drafted_per_step(decoder, cfg)
        decoder.cost_policy = cheap_drafting()
        without, out_without = _drafted_per_step(decoder, replace(cfg, use_head=False))
    finally:
        decoder.drafter.head, decoder.cost_policy = None, kept
    # the random tiny drafter's max q is low: without the head its drafts are short or skipped
    assert with_head > 3.0 and without < 0.5 * with_head and out == out_without


def test_head_stop_without_a_head_is_a_clear_error(decoder):
    with pytest.raises(OmnidraftError, match="acceptance head"):
        decoder.generate([5, 6, 7], DecodeConfig(max_new_tokens=4, draft_stop="head"))


def test_draft_stop_is_validated():
    with pytest.raises(OmnidraftError, match="draft stop"):
        DecodeConfig(draft_stop="sometimes").validate()
    with pytest.raises(OmnidraftError, match="stop-gamma"):
        DecodeConfig(stop_gamma=1.0).validate()


def test_minus_inf_logits_are_tokens_with_no_probability_on_both_paths():
    """A pruned drafter head gives -inf for the tokens it leaves out: the features and the one-row path are
    those of the distribution over the other tokens, finite (0 · -inf would make the entropy NaN)."""
    torch.manual_seed(1)
    head = accept_head.AcceptHead(8, width=4)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5)
    hidden, kept = torch.randn(8), torch.randn(50) * 3
    pruned = torch.cat([kept, torch.full((30,), float("-inf"))])
    f_pruned, f_kept = accept_head.features(hidden[None], pruned[None]), accept_head.features(hidden[None], kept[None])
    assert torch.isfinite(f_pruned).all() and torch.allclose(f_pruned, f_kept, atol=1e-5)
    assert head.accept_prob(hidden, pruned) == pytest.approx(head.accept_prob(hidden, kept), rel=1e-5)
    assert math.isfinite(head.accept_prob(hidden, pruned))
