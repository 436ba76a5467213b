"""Vocabulary bridge properties on the real tokenizers (SmolLM2 <-> Qwen2.5, SmolLM2 <-> Gemma-3)."""

from __future__ import annotations

import pytest
from conftest import DRAFTER, TARGETS
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from omnidraft.ngram import NgramTrie
from omnidraft.runtime import build_bridge
from omnidraft.vocab.reverse import DrafterContext

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=60)


@pytest.fixture(scope="module", params=TARGETS)
def bridge(request, real_models):
    d_model, d_tok = real_models(DRAFTER)
    t_model, t_tok = real_models(request.param)
    return build_bridge(d_model, d_tok, t_model, t_tok)


@pytest.mark.real
def test_direct_mapped_pairs_decode_to_same_bytes(bridge):
    pairs = [(d, t) for d, t in enumerate(bridge.d2t_list) if t >= 0]
    assert len(pairs) == bridge.intersection_size > 10_000
    for d, t in pairs:
        db, tb = bridge.drafter_bytes(d), bridge.target_bytes(t)
        if db is None:  # special tokens pair by literal text
            assert bridge.d.special_text[d] == bridge.t.special_text[t]
        else:
            assert db == tb


@pytest.mark.real
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(head=TEXT, tail=TEXT, cut=st.integers(0, 60), special=st.booleans())
def test_plain_steps_appended_at_once_spell_the_text_and_keep_what_came_before(bridge, head, tail, cut, special):
    """A plain step's tokens join the drafter's context when drafting resumes (``append_text``), all at
    once: the context must spell the text, special tokens included, and leave the drafter tokens before
    its look-behind as they were (the drafter's KV cache holds them)."""
    t_ids = bridge.target_tokenizer.encode(head, add_special_tokens=False)
    more = bridge.target_tokenizer.encode(tail, add_special_tokens=False)
    if special:  # a turn's end marker inside the plain steps' tokens
        more.insert(min(cut, len(more)), bridge.target_tokenizer.convert_tokens_to_ids(bridge.target_tokenizer.eos_token))
    whole = DrafterContext(bridge, t_ids + more)
    ctx = DrafterContext(bridge, t_ids)
    before = list(ctx.ids)
    ctx.append_text(more)
    spell = lambda ids: b"".join(bridge.drafter_bytes(i) or bridge.d.special_text[i].encode() for i in ids)
    assert spell(ctx.ids) == spell(whole.ids)
    assert ctx.ids[: max(len(before) - 8, 0)] == before[: max(len(before) - 8, 0)]


@pytest.mark.real
def test_token_bytes_match_the_tokenizers_own_decoding(bridge):
    for tok, table in ((bridge.drafter_tokenizer, bridge.d), (bridge.target_tokenizer, bridge.t)):
        text = "naïve café — 東京 🙂 def f(x):\n\treturn x  # done"
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(table.token_bytes[i] for i in ids) == text.encode()


@pytest.mark.real
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_reverse_of_forward_reproduces_text(bridge, text):
    """Target tokens -> drafter tokens (reverse) -> drafter proposals -> target tokens (forward).

    The reference is what the target's tokens spell, not the input text: a tokenizer may
    normalise (Qwen's NFC maps the compatibility ideograph U+F900 to U+8C48), and the bridge must
    mirror the target's text, whatever its tokenizer made of the input."""
    t_ids = bridge.target_tokenizer.encode(text, add_special_tokens=False)
    spelled = b"".join(bridge.target_bytes(t) for t in t_ids)
    assume(bridge.representable(spelled))
    text = spelled.decode("utf-8")
    d_ids = bridge.target_to_drafter(t_ids)
    assert b"".join(bridge.drafter_bytes(i) for i in d_ids) == text.encode()
    # Learn every 1 -> n mapping token by token, as the decode loop does, then translate forward.
    ngrams = NgramTrie()
    ctx = DrafterContext(bridge, [])
    for t in t_ids:
        ctx.append_target(t, ngrams)
    assert b"".join(bridge.drafter_bytes(i) for i in ctx.ids) == text.encode()
    tr = bridge.forward(ctx.ids, ngrams)
    back = b"".join(bridge.target_bytes(t) for t in tr.target_ids)
    assert text.encode().startswith(back)
    if tr.drafted_used == len(ctx.ids):
        assert back == text.encode()
    assert b"".join(bridge.drafter_bytes(i) for i in bridge.target_to_drafter(tr.target_ids)) == back


@pytest.mark.real
def test_bytes_the_drafter_cannot_spell_are_skipped_not_fatal(bridge):
    missing = [b for b in range(256) if bridge.d.byte_token[b] is None]
    assert 0xF1 in missing  # a fact of SmolLM2's vocabulary, the case this test is about
    text = "ok \U00040000 fine"  # U+40000 is F1 80 80 80 in UTF-8
    assert not bridge.representable(text.encode())
    d_ids = bridge.target_to_drafter(bridge.target_tokenizer.encode(text, add_special_tokens=False))
    spelled = b"".join(bridge.drafter_bytes(i) for i in d_ids)
    assert spelled.startswith(b"ok ") and spelled.endswith(b" fine")


@pytest.mark.real
def test_text_translation_aligns_a_drafter_token_spanning_two_target_tokens(qwen_bridge):
    """SmolLM2 spells a new code line as one '\\n' + indent token; Qwen as '):\\n' + indent."""
    br = qwen_bridge
    context = br.target_tokenizer.encode("    for i in range(len(numbers", add_special_tokens=False)
    drafted = br.drafter_tokenizer.encode(")):\n        for j", add_special_tokens=False)
    newline_indent = [d for d in drafted if br.drafter_bytes(d) == b"\n       "]
    assert newline_indent and br.d2t_list[newline_indent[0]] < 0  # no direct mapping exists
    assert br.forward(drafted, NgramTrie()).target_ids == br.forward(drafted[:1], None).target_ids  # token path stops
    proposed = br.forward_text(context, drafted).target_ids
    canonical = br.target_tokenizer.encode("    for i in range(len(numbers)):\n        for j", add_special_tokens=False)
    assert context + proposed == canonical


@pytest.mark.real
def test_reverse_after_text_translation_keeps_whole_drafted_tokens(qwen_bridge):
    br = qwen_bridge
    ctx = DrafterContext(br, br.target_tokenizer.encode("x = 1", add_special_tokens=False))
    before = list(ctx.ids)
    drafted = br.drafter_tokenizer.encode(" + 2\nprint(x)", add_special_tokens=False)
    accepted = b" + 2\npr"  # the target accepted text ending inside a drafted token
    rest = ctx.extend_accepted_bytes(drafted, accepted)
    kept = ctx.ids[len(before):]
    assert kept == drafted[: len(kept)] and b"".join(br.drafter_bytes(t) for t in kept) + rest == accepted
    ctx.append_target(br.target_tokenizer.encode("int", add_special_tokens=False)[0], None, before=rest)
    assert b"".join(br.drafter_bytes(t) for t in ctx.ids) == b"x = 1 + 2\nprint"


# ---------------------------------------------------------------- CJK: byte tokens on the drafter's side

ZH = "请帮我起草一份专利和技术秘密转让合同。"


@pytest.mark.real
def test_chinese_text_teaches_the_ngram_cache_its_merges(qwen_bridge):
    """Reverse translation of Qwen's multi-character tokens learns the drafter byte sequences that
    spell them, and token translation then proposes those tokens whole, never their bytes."""
    br = qwen_bridge
    ids = br.target_tokenizer.encode(ZH, add_special_tokens=False)
    trie = NgramTrie()
    ctx = DrafterContext(br, [])
    for tok in ids:
        ctx.append_target(tok, trie)
    assert b"".join(br.drafter_bytes(t) for t in ctx.ids) == ZH.encode()
    learned = [t for t in ids if br.t2d[t] < 0]
    assert len(learned) >= len(ids) // 2  # most of Qwen's Chinese tokens have no drafter partner
    assert br.forward(ctx.ids, trie).target_ids == ids
