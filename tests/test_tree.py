"""Token trees: the drafter's runner-up tokens verified as branches beside its chain.

The walk and the mask on their own; the eager engine's tree read against plain reads of each path
on a tiny random model; the verifier taking a branch; the text translator's branches; the cost
policy's choice of how many rows. The real-model losslessness is in test_lossless_real.py."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model, tiny_pair
from transformers import Qwen2Config, Qwen2ForCausalLM

from omnidraft.config import MAX_BRANCH_ROWS, DecodeConfig
from omnidraft.costs import AcceptanceStats, DraftCost, VerifyCosts
from omnidraft.drafter.base import Draft
from omnidraft.kv import CachedLM, tree_mask, tree_positions
from omnidraft.sources.base import StepResult, StepTimes
from omnidraft.sources.policy import CostPolicy
from omnidraft.target import TorchTarget
from omnidraft.target.base import LocalVerifier
from omnidraft.verify.proposal import Proposal
from omnidraft.verify.tree import Branch, check_branches, fit_branches, walk
from omnidraft.vocab.translate import TextTranslator

GREEDY = DecodeConfig(verify="greedy")


def test_walk_follows_the_chain_then_a_branch_that_starts_with_the_targets_token():
    proposed = [5, 6, 7]
    branches = [Branch(1, (8, 9)), Branch(1, (3, 4, 2)), Branch(3, (1,))]
    # rows: chain 0..3, then (8, 9) at 4-5, (3, 4, 2) at 6-8, (1,) at 9
    choices = [5, 3, 0, 0, -1, -1, 4, 9, -1, -1]  # agrees with 5, wants 3 instead of 6, then 4, then not 2
    found = walk(choices, proposed, branches)
    assert (found.path, found.next_token, found.rows, found.branch_kept) == ([5, 3, 4], 9, [0, 1, 6, 7], 2)


def test_walk_without_a_matching_branch_is_the_chain_rule():
    found = walk([5, 6, 1, 0, 7, 7], [5, 6, 7], [Branch(2, (2,)), Branch(1, (1,))])
    assert (found.path, found.next_token, found.rows, found.branch_kept) == ([5, 6], 1, [0, 1, 2], 0)


def test_walk_takes_a_branch_that_continues_the_whole_chain():
    found = walk([5, 6, 1, 3], [5, 6], [Branch(2, (1,))])
    assert (found.path, found.next_token, found.rows) == ([5, 6, 1], 3, [0, 1, 2, 3])


def test_branches_are_cut_to_the_chain_and_the_room():
    branches = [Branch(0, (1, 2)), Branch(3, (4,)), Branch(2, (5, 6))]
    assert fit_branches(branches, proposed=2, room=3) == [Branch(0, (1, 2)), Branch(2, (5,))]
    with pytest.raises(ValueError):
        check_branches([Branch(3, (1,))], proposed=2)
    with pytest.raises(ValueError):
        check_branches([Branch(0, ())], proposed=2)


def test_a_branch_row_sees_its_path_and_not_the_chain_it_replaces():
    # 2 cached, new = [last, p0, p1], branch at depth 1 of two tokens
    mask = tree_mask(2, 3, 2, [Branch(1, (7, 8))], torch.float32)[0, 0] == 0
    assert mask.shape == (5, 7)
    assert mask[2].tolist() == [True] * 5 + [False, False]  # p1: cache, last, p0, itself
    assert mask[3].tolist() == [True, True, True, True, False, True, False]  # 7: cache, last, p0 (not p1), itself
    assert mask[4].tolist() == [True, True, True, True, False, True, True]
    assert tree_positions(2, 3, 2, [Branch(1, (7, 8))]) == [2, 3, 4, 4, 5]


@pytest.fixture(scope="module")
def tiny_lm():
    return tiny_model(64, seed=3)


def _plain(model, ids: list[int], keep: int) -> torch.Tensor:
    lm = CachedLM(model)
    return lm.logits_for(ids, keep)


def test_a_tree_read_gives_each_path_the_rows_of_reading_it_alone(tiny_lm):
    lm = CachedLM(tiny_lm)
    context, chain = [3, 9, 14, 20, 2], [11, 12, 13]
    branches = [Branch(0, (40, 41)), Branch(2, (50,)), Branch(3, (60,))]
    lm.logits_for(context, 1)
    rows = lm.logits_for(context + chain, 4, branches)
    assert rows.shape[0] == 4 + 4
    torch.testing.assert_close(rows[:4], _plain(tiny_lm, context + chain, 4))
    torch.testing.assert_close(rows[4:6], _plain(tiny_lm, context + [40, 41], 2))
    torch.testing.assert_close(rows[6:7], _plain(tiny_lm, context + chain[:2] + [50], 1))
    torch.testing.assert_close(rows[7:8], _plain(tiny_lm, context + chain + [60], 1))
    # the cache holds the chain only: reading on after it, or after a branch, is what a plain read gives
    assert lm.cached_ids == context + chain and lm.cache.get_seq_length() == len(context + chain)
    torch.testing.assert_close(lm.logits_for(context + chain + [7], 1), _plain(tiny_lm, context + chain + [7], 1))
    torch.testing.assert_close(lm.logits_for(context + [40, 41, 5], 1), _plain(tiny_lm, context + [40, 41, 5], 1))


def test_an_engine_with_sliding_windows_refuses_trees():
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, use_sliding_window=True, sliding_window=8)
    lm = CachedLM(Qwen2ForCausalLM(config).eval())
    assert not lm.trees
    with pytest.raises(ValueError, match="trees"):
        lm.logits_for([1, 2, 3], 2, [Branch(0, (4,))])


def test_the_verifier_takes_a_branch_the_target_agrees_with(tiny_lm):
    tok = type("Tok", (), {"eos_token_id": 0})()
    target = TorchTarget(tiny_lm, tok)
    verifier = LocalVerifier(target)
    context = [3, 9, 14, 20, 2]
    greedy, ids = [], list(context)
    for _ in range(3):  # the target's own greedy continuation
        greedy.append(int(_plain(tiny_lm, ids, 1)[0].argmax()))
        ids.append(greedy[-1])
    wrong = (greedy[0] + 1) % 64
    proposal = Proposal([wrong, 1], branches=[Branch(0, (wrong, 5)), Branch(0, (greedy[0], greedy[1]))])
    verdict = verifier.verify(context, proposal, GREEDY, None)
    assert (verdict.accepted, verdict.next_token, verdict.path, verdict.branch_kept) == (2, greedy[2], greedy[:2], 2)
    torch.testing.assert_close(verdict.rows, _plain(tiny_lm, context + greedy[:2], 3))
    # an engine that cannot read trees verifies the chain alone
    chains = TorchTarget(tiny_lm, tok)
    chains.lm.trees = False
    verdict = LocalVerifier(chains).verify(context, Proposal([wrong], branches=[Branch(0, (greedy[0],))]), GREEDY, None)
    assert (verdict.accepted, verdict.next_token, verdict.path) == (0, greedy[0], None)


def test_text_branches_hang_where_the_runner_up_text_leaves_the_chain():
    d_model, target, bridge = tiny_pair()
    translator = TextTranslator(bridge)
    context = target.tokenizer.encode("the cat sat on the")
    drafted = bridge.drafter_tokenizer.encode(" mat and the dog")
    runners_up = bridge.drafter_tokenizer.encode(" log or a cat")[: len(drafted)]
    draft = Draft(drafted, None, runners_up=runners_up + [-1] * (len(drafted) - len(runners_up)))
    tr = translator.forward(context, draft)
    branches = translator.branches(context, draft, tr, rows=16)
    assert branches and sum(len(b.tokens) for b in branches) <= 16
    texts = [bridge.drafter_tokenizer.decode(drafted[:i] + [other]) for i, other in enumerate(draft.runners_up) if other >= 0]
    for b in branches:
        assert b.tokens[0] != (tr.target_ids + [None])[b.depth]  # it leaves the chain where it starts
        path = target.tokenizer.decode(tr.target_ids[: b.depth] + list(b.tokens))
        assert any(text.startswith(path) for text in texts), path  # spelled by the draft with one runner-up
    assert len({(b.depth, b.tokens[0]) for b in branches}) == len(branches)
    assert sum(len(b.tokens) for b in translator.branches(context, draft, tr, rows=1)) == 1


def _policy(costs: dict[int, float]) -> CostPolicy:
    policy = CostPolicy()
    policy.verify_costs = VerifyCosts(costs)
    policy.draft_cost = DraftCost(0.005)
    policy.acceptance["drafter"] = AcceptanceStats(16, prior_mean=0.6)
    return policy


def test_the_cost_policy_adds_branch_rows_while_they_are_expected_to_pay():
    flat = _policy({k: 0.1 for k in range(17)})
    assert flat.branch_rows(4, -1) == 4  # one per depth the chain may first be rejected at
    assert flat.branch_rows(4, 2) == 2 and flat.branch_rows(4, 0) == 0
    steep = _policy({k: 0.1 * (k + 1) for k in range(17)})  # every row costs a step: none pays
    assert steep.branch_rows(4, -1) == 0
    knee = _policy({**{k: 0.1 for k in range(7)}, **{k: 0.2 for k in range(7, 17)}})  # a second pass from 8 rows
    assert knee.branch_rows(4, -1) == 2


def test_branch_hits_are_learnt_where_the_chain_stopped_at_a_branch():
    policy = _policy({k: 0.1 for k in range(17)})
    before = policy.branch_hits.rate(1)
    miss = StepResult("drafter", "drafter", False, Proposal([1, 2, 3], branches=[Branch(1, (9,))]), 3, 1, [1, 4],
                      False, None, StepTimes(0.01, 0.0, 0.1), kept=1)
    for _ in range(10):
        policy.learn(miss, reads_prompt=False)
    assert policy.branch_hits.rate(1) < before / 2
    elsewhere = StepResult("drafter", "drafter", False, Proposal([1, 2, 3], branches=[Branch(2, (9,))]), 3, 1, [1, 4],
                           False, None, StepTimes(0.01, 0.0, 0.1), kept=1)
    low = policy.branch_hits.rate(1)
    policy.learn(elsewhere, reads_prompt=False)  # stopped at depth 1, its branch hangs at 2: no evidence
    assert policy.branch_hits.rate(1) == low
    hit = StepResult("drafter", "drafter", False, Proposal([1, 2, 3], branches=[Branch(1, (9,))]), 3, 2, [1, 9, 5],
                     False, None, StepTimes(0.01, 0.0, 0.1), kept=1, branch_kept=1)
    policy.learn(hit, reads_prompt=False)
    assert policy.branch_hits.rate(1) > low
    assert policy.verify_costs.observations[3 + 1] == 12  # V counts the branch rows


def test_the_runner_up_is_the_best_other_allowed_token_and_the_row_is_left_as_it_was():
    from omnidraft.drafter.drafter import runner_up

    row = torch.tensor([0.5, 3.0, -float("inf"), 2.0, 1.0])
    before = row.clone()
    assert runner_up(row, 1) == 3 and runner_up(row, 3) == 1
    assert torch.equal(row, before)
    assert runner_up(torch.tensor([-float("inf"), 1.0, -float("inf")]), 1) == -1  # nothing else is allowed
