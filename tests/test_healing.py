"""Token healing (omnidraft/vocab/healing.py): a drafter context that ends in a whitespace token is
drafted from before it, its first token constrained to begin with that token's bytes; the translator
drops those bytes from the drafted text and reverse translation keeps the drafter's own spelling."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import DRAFTER

from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.drafter import Draft, Drafter
from omnidraft.runtime import build_bridge, encode_prompt, make_drafter
from omnidraft.target import TorchTarget
from omnidraft.vocab.healing import TokenHealing
from omnidraft.vocab.reverse import DrafterContext
from omnidraft.vocab.translate import TextTranslator, TokenTranslator


def _spell(bridge, ids: list[int]) -> bytes:
    return b"".join(bridge.drafter_bytes(t) or b"" for t in ids)


def test_only_whitespace_tokens_that_longer_tokens_begin_with_are_healed():
    table = [b"\n", b"\n    ", b"\n\n", b" the", b" there", b"x", b"   ", None, b"\t", b"    "]
    healing = TokenHealing(table, len(table) + 3)  # a model's vocabulary may be wider than its tokenizer
    overlap, bias = healing.heal(0)
    assert overlap == b"\n" and bias.shape == (len(table) + 3,)
    assert torch.isfinite(bias).nonzero().flatten().tolist() == [0, 1, 2]  # "\n" itself and what extends it
    assert healing.heal(6)[0] == b"   " and torch.isfinite(healing.heal(6)[1]).nonzero().flatten().tolist() == [6, 9]
    assert healing.heal(3) is None  # " the": a word the target ended is a word
    assert healing.heal(5) is None and healing.heal(7) is None  # not whitespace; a special token
    assert healing.heal(8) is None  # "\t": whitespace, but nothing longer begins with it
    assert healing.heal(len(table) + 1) is None  # past the token table


@pytest.mark.real
def test_a_healed_draft_is_proposed_without_its_overlap_and_kept_as_the_drafter_spelled_it(qwen_bridge):
    """Qwen ends a step on "):\\n"; SmolLM2's context then ends in a bare "\\n" that it would have spelled
    together with the next line's indent. The healed draft's first token is that "\\n" + indent."""
    br = qwen_bridge
    text = "def f(x):\n"
    t_ids = br.target_tokenizer.encode(text, add_special_tokens=False)
    ctx = DrafterContext(br, t_ids)
    assert br.drafter_bytes(ctx.ids[-1]) == b"\n"
    translator = TextTranslator(br)
    overlap, bias = translator.heal(ctx.ids, br.drafter_vocab_size)
    assert overlap == b"\n"
    drafted = br.drafter_tokenizer.encode("\n    return x + 1", add_special_tokens=False)
    assert torch.isfinite(bias[drafted[0]]) and br.drafter_bytes(drafted[0]).startswith(b"\n ")
    draft = Draft(drafted, None, ctx.ids[:-1], overlap=overlap)

    tr = translator.forward(t_ids, draft)
    whole = br.target_tokenizer.encode(text + "    return x + 1", add_special_tokens=False)
    assert t_ids + tr.target_ids == whole  # the overlap is the context's, not proposed again

    # the target keeps every proposal and adds a bonus token: the drafter's tokens stay as it drafted them
    bonus = br.target_tokenizer.encode("\n", add_special_tokens=False)
    emitted = tr.target_ids + bonus
    assert translator.drafted_kept(draft, tr, len(tr.target_ids), tr.target_ids) == len(drafted)
    n = len(ctx.ids)
    translator.reverse(ctx, draft, tr, emitted, len(tr.target_ids))
    assert _spell(br, ctx.ids) == (text + "    return x + 1\n").encode()
    assert ctx.ids[n - 1] == drafted[0] and len(drafted) > 4  # (the bonus token re-tokenizes the last 3 only)

    # the target rejects the first proposal (another indent): the context still spells the text
    ctx = DrafterContext(br, t_ids)
    other = br.target_tokenizer.encode("  pass", add_special_tokens=False)
    translator.reverse(ctx, draft, tr, other[:1], 0)
    assert translator.drafted_kept(draft, tr, 0, tr.target_ids) == 0
    assert _spell(br, ctx.ids) == text.encode() + br.target_bytes(other[0])


@pytest.mark.real
def test_text_that_does_not_begin_with_the_overlap_is_refused(qwen_bridge):
    br = qwen_bridge
    drafted = br.drafter_tokenizer.encode("return x", add_special_tokens=False)
    with pytest.raises(ValueError, match="begin with the bytes it heals"):
        br.forward_text(br.target_tokenizer.encode("x", add_special_tokens=False), drafted, overlap=b"\n")


@pytest.mark.real
def test_healed_drafts_keep_the_targets_output_and_the_drafters_context_in_step(real_models):
    """Greedy decoding of a code prompt heals drafts (its prompt ends in a line break, and so do many of
    its steps), gives the target's own tokens with or without healing, and leaves the drafter's context
    spelling the text byte for byte. Sampling translators never heal (they need per-token q')."""
    d_model, d_tok = real_models(DRAFTER)
    t_model, t_tok = real_models("builtin:qwen2.5-coder-0.5b")
    target = TorchTarget(t_model, t_tok)
    bridge = build_bridge(d_model, d_tok, t_model, t_tok)
    decoder = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)
    healed: list[bytes] = []
    draft = Drafter.draft

    def spy(self, context, k, policy, first=None):
        out = draft(self, context, k, policy, first)
        healed.append(first is not None)
        return out

    ids = encode_prompt(t_tok, 'def count_vowels(s: str) -> int:\n    """Count the vowels in s."""\n')
    plain = SpeculativeDecoder(target).generate(ids, DecodeConfig(max_new_tokens=48)).token_ids
    base = DecodeConfig(max_new_tokens=48, draft_len=4, draft_stop="fixed", lookup=False, branch_rows=0)
    try:
        Drafter.draft = spy
        got = decoder.generate(ids, base).token_ids
        with_healing = list(healed)
        healed.clear()
        off = decoder.generate(ids, replace(base, heal=False)).token_ids
        without = list(healed)
    finally:
        Drafter.draft = draft
    assert got == plain and off == plain
    assert any(with_healing) and not any(without)
    source = decoder.source("drafter")  # its context, and the tokens of steps that wait to join it
    spelled = _spell(bridge, source._ctx.ids) + b"".join(bridge.target_bytes(t) or b"" for t in source._pending)
    assert spelled == b"".join(bridge.target_bytes(t) or b"" for t in ids + off)
    assert not hasattr(TokenTranslator, "heal")
