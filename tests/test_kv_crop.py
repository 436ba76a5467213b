"""After a rejection the KV cache is cropped; the next forward must equal a fresh forward on the
same prefix — for the drafter and both targets, Gemma-3 beyond its 512-token sliding window."""

from __future__ import annotations

import pytest
import torch
from conftest import DRAFTER, TARGETS

from omnidraft.kv import CachedLM, common_prefix_len


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5, 6, 7, 8, 9], [5, 6, 7, 8, 0]) == 4


@pytest.mark.real
@pytest.mark.parametrize("spec", [DRAFTER] + TARGETS)
def test_crop_then_forward_equals_fresh_forward(real_models, spec):
    model, tok = real_models(spec)
    text = "The quick brown fox jumps over the lazy dog. " * 70
    ids = tok.encode(text, add_special_tokens=False)
    prefix = ids[: 560 if "gemma" in spec else 120]  # Gemma-3's sliding window is 512 tokens
    rejected = tok.encode(" zebra umbrella lantern", add_special_tokens=False)
    accepted = tok.encode(" and then it slept", add_special_tokens=False)

    lm = CachedLM(model)
    lm.logits_for(prefix + rejected, keep=len(rejected) + 1)
    got = lm.logits_for(prefix + accepted, keep=len(accepted) + 1)
    assert lm.cached_ids == prefix + accepted

    fresh = CachedLM(model)
    fresh.logits_for(prefix)
    same_ops = fresh.logits_for(prefix + accepted, keep=len(accepted) + 1)
    torch.testing.assert_close(got, same_ops, rtol=0, atol=0)

    one_shot = CachedLM(model).logits_for(prefix + accepted, keep=len(accepted) + 1)
    torch.testing.assert_close(got, one_shot, rtol=1e-4, atol=2e-3)
    assert torch.equal(got.argmax(-1), one_shot.argmax(-1))
