"""What the drafting machinery costs a step when the cost policy declines to draft.

A user whose drafter is too slow for the target gets plain target steps; the sources, the policy and
the accounting around them must then cost next to nothing beside a target step (docs/performance.md
has the measured ratio). Time cannot be asserted in a unit test, so this counts
work instead: the Python and builtin calls of a declined step, beyond those of the same target's
step with no machinery. A per-step scan of the vocabulary, of the context or of the cache would
multiply them; the bound leaves room for a few small additions, no more.
"""

from __future__ import annotations

import sys

from tiny import holding_costs, tiny_pair

from omnidraft.config import DecodeConfig
from omnidraft.costs import DraftCost, VerifyCosts
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import make_drafter

NEW_TOKENS = 24
# Extra calls a declined step makes today: about 160 (the offers of the sources, the policy's
# decision for each, the context sync and the accounting). About twice that fails the test.
EXTRA_CALLS_PER_STEP = 300


def _calls(decoder: SpeculativeDecoder, prompt: list[int]) -> tuple[int, list[int], int]:
    """(calls made while generating, the ids, steps) for one request."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    config = DecodeConfig(max_new_tokens=NEW_TOKENS)  # draft_stop auto: the cost policy decides
    sys.setprofile(profile)
    try:
        result = decoder.generate(prompt, config)
    finally:
        sys.setprofile(None)
    return count, result.token_ids, result.stats.steps


def _declining(decoder: SpeculativeDecoder) -> SpeculativeDecoder:
    """A cost policy that has measured a machine where no draft pays: one proposal costs as much as
    a hundred plain steps and the drafter a plain step per token (the warm-up requests may still
    explore once; the measured ones must decline every step)."""
    policy = decoder.cost_policy
    policy.verify_costs = VerifyCosts({0: 0.001, 1: 0.1, 16: 1.6})
    policy.draft_cost = DraftCost(0.001)
    holding_costs(policy)  # the steps timed here (under a profiler) must not move them
    return decoder


def test_a_declined_step_costs_a_bounded_number_of_calls_beyond_the_target_alone():
    d_model, target, bridge = tiny_pair()
    full = _declining(SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge))
    alone = SpeculativeDecoder(target)
    prompt = target.tokenizer.encode("the cat sat on the mat and the dog", add_special_tokens=False)
    assert [s.name for s in full.sources] == ["context", "drafter"]  # the machinery a user has on
    _calls(full, prompt), _calls(alone, prompt)  # warm: lazy imports and first-use caches
    full_calls, full_ids, steps = _calls(full, prompt)
    alone_calls, alone_ids, alone_steps = _calls(alone, prompt)
    assert full_ids == alone_ids and steps == alone_steps == NEW_TOKENS
    assert full.stats.plain_steps == steps  # it declined every step
    extra = (full_calls - alone_calls) / steps
    assert 0 < extra <= EXTRA_CALLS_PER_STEP, f"a declined step makes {extra:.0f} calls beyond the target's own"


def test_the_fast_argmax_picks_what_torch_picks():
    """Greedy verification takes numpy's argmax on CPU float32 rows: the same ids as torch's,
    including the first of tied maxima, a NaN row and the other dtypes (which keep torch's)."""
    import torch

    from omnidraft.verify.greedy import argmax_rows, greedy_verify

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(9, 151_936, generator=gen)
    rows[2, [7, 70_000]] = 1e4  # a tie: the first wins
    rows[3, 11] = float("nan")
    for logits in (rows, rows.to(torch.bfloat16), rows.to(torch.float64)):
        assert argmax_rows(logits) == logits.argmax(-1).tolist()
    assert argmax_rows(rows)[2] == 7
    choice = rows.argmax(-1).tolist()
    assert greedy_verify(rows, choice[:4] + [choice[4] + 1]) == (4, choice[4])
