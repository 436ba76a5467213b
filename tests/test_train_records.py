"""Training records: the recorder's sparse target distributions, and the DM / n-gram masks of
eq. (4) on real bridged text (SmolLM2 -> Qwen2.5 and -> Gemma-3)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import DRAFTER, TARGETS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnidraft.runtime import build_bridge
from omnidraft.train.records import (
    KIND_DM,
    KIND_NGRAM,
    KIND_NONE,
    KIND_SPAN,
    Recorder,
    align,
    preimage_table,
    to_example,
)


def test_recorder_keeps_top_k_of_the_intersection_and_the_exact_log_probs():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    inter = torch.zeros(50, dtype=torch.bool)
    inter[::3] = True  # every third target token has a drafter partner
    got = []
    rec = Recorder(inter, sink=got.append, top_k=4)
    rec.on_start([7, 8])
    rec.on_step(logits[:2], [5, 9])
    rec.on_step(logits[2:], [12])
    rec.on_finish()
    (record,) = got
    logp = logits.log_softmax(-1)
    assert record.prompt_ids == [7, 8] and record.emitted_ids == [5, 9, 12]
    assert inter[record.topk_ids.long()].all()
    best = logp[:, inter].topk(4).values
    assert torch.allclose(record.topk_logp, best)
    assert torch.allclose(record.log_mass, logp[:, inter].logsumexp(-1))
    assert torch.allclose(record.logp_emitted, logp[torch.arange(3), torch.tensor([5, 9, 12])])


def test_recorder_sends_nothing_for_an_empty_request():
    got = []
    rec = Recorder(torch.ones(10, dtype=torch.bool), sink=got.append)
    rec.on_start([1])
    rec.on_finish()
    assert got == []


@pytest.fixture(scope="module", params=TARGETS)
def bridge(request, real_models):
    d_model, d_tok = real_models(DRAFTER)
    t_model, t_tok = real_models(request.param)
    return build_bridge(d_model, d_tok, t_model, t_tok)


def _check_alignment(bridge, emitted):
    tokens, kinds, rows = align(bridge, emitted)
    assert len(tokens) == len(kinds) == len(rows)
    plain = [t for t in emitted if bridge.target_bytes(t) is not None]
    drafted_bytes = b"".join(bridge.drafter_bytes(t) or b"" for t in tokens)
    text = b"".join(bridge.target_bytes(t) for t in plain)
    if not bridge.representable(text):  # a byte the drafter cannot spell: no label is trusted
        assert set(kinds) <= {KIND_NONE, KIND_DM} and all(bridge.target_bytes(emitted[r]) is None for r, k in zip(rows, kinds) if k == KIND_DM)
        return tokens, kinds, rows
    assert drafted_bytes == text  # the drafter tokens tile the text
    if len(plain) == len(emitted):  # one run of text: straddlers as an independent rule finds them
        assert [k == KIND_SPAN for k in kinds] == [k == KIND_SPAN for k in _span_kinds(bridge, plain)[1]]
    for row, group in itertools.groupby(range(len(tokens)), key=lambda j: (rows[j], kinds[j])):
        idx = list(group)
        target_row, kind = row
        if kind in (KIND_NONE, KIND_SPAN):
            continue
        data = b"".join(bridge.drafter_bytes(tokens[j]) or b"" for j in idx)
        if kind == KIND_DM:
            assert len(idx) == 1
            if bridge.target_bytes(emitted[target_row]) is None:  # special token, by literal text
                assert tokens[idx[0]] == int(bridge.t2d[emitted[target_row]])
            else:
                assert data == bridge.target_bytes(emitted[target_row])
                assert bridge.d2t_list[tokens[idx[0]]] >= 0
        else:
            assert kind == KIND_NGRAM and len(idx) >= 2
            assert data == bridge.target_bytes(emitted[target_row])
    return tokens, kinds, rows


def _span_kinds(bridge, plain: list[int]) -> tuple[list[int], list[int]]:
    """Independently of ``align``: a drafter token straddles (KIND_SPAN) when a target boundary lies
    strictly inside it, or when the target token around it does not start and end on drafter
    boundaries (so no exact tiling labels it)."""
    text = b"".join(bridge.target_bytes(t) for t in plain)
    t_bounds = list(itertools.accumulate(len(bridge.target_bytes(t)) for t in plain))
    tokens = bridge.drafter_encode(text)
    d_ends = list(itertools.accumulate(len(bridge.drafter_bytes(t) or b"") for t in tokens))
    d_bounds = {0, *d_ends}
    kinds = []
    for start, end in zip([0] + d_ends[:-1], d_ends):
        inside = any(start < b < end for b in t_bounds)
        lo = max([0] + [b for b in t_bounds if b <= start])
        hi = min(b for b in t_bounds if b >= end)
        kinds.append(KIND_SPAN if inside or lo not in d_bounds or hi not in d_bounds else KIND_DM)
    return tokens, kinds


@pytest.mark.real
def test_code_line_breaks_are_span_tokens_and_reach_the_example(bridge):
    tok = bridge.target_tokenizer
    emitted = tok.encode("def f(x):\n    if x:\n        return x\n    return 0", add_special_tokens=False)
    tokens, kinds, _ = _check_alignment(bridge, emitted)
    expected_tokens, expected = _span_kinds(bridge, emitted)
    assert tokens == expected_tokens
    spans = [j for j, k in enumerate(kinds) if k == KIND_SPAN]
    assert spans == [j for j, k in enumerate(expected) if k == KIND_SPAN]
    prompt = tok.encode("Write f.", add_special_tokens=False)
    preimages, _ = preimage_table(bridge)
    ex = to_example(_fake_record(bridge, prompt, emitted, 4), bridge, preimages)
    base = len(bridge.target_to_drafter(prompt))
    assert ex.span_pos.tolist() == [base + j for j in spans]
    if bridge.target_tokenizer.decode(tok.encode(":\n", add_special_tokens=False)[:1]) == ":\n":
        # Qwen spells ':\n' as one token, SmolLM2 spells ':' then '\n' + indent: a line break straddles
        assert any(bridge.drafter_bytes(tokens[j]).startswith(b"\n ") for j in spans)


@pytest.mark.real
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=50))
def test_alignment_properties_on_real_tokenizers(bridge, text):
    _check_alignment(bridge, bridge.target_tokenizer.encode(text, add_special_tokens=False))


def _ngram_word(bridge) -> tuple[int, bytes]:
    """A target token the drafter has no partner for and spells with several tokens."""
    for tid, data in enumerate(bridge.t.token_bytes):
        if data and data.startswith(b" ") and data[1:].isalpha() and len(data) >= 8 and bridge.t2d[tid] < 0:
            if len(bridge.drafter_encode(data)) >= 2:
                return tid, data
    raise AssertionError("no n-gram candidate in the target vocabulary")


@pytest.mark.real
def test_masks_on_a_real_bridged_example(bridge):
    word_id, word = _ngram_word(bridge)
    tok = bridge.target_tokenizer
    emitted = tok.encode("x = 1\nprint(x)", add_special_tokens=False) + [word_id] + tok.encode(" done.", add_special_tokens=False)
    eos = [t for t in bridge.t.special_text if int(bridge.t2d[t]) >= 0 and t < len(bridge.t2d)]
    emitted += eos[:1]  # a special token with a literal-text partner, if the pair has one
    tokens, kinds, rows = _check_alignment(bridge, emitted)
    word_row = emitted.index(word_id)
    assert [k for k, r in zip(kinds, rows) if r == word_row] == [KIND_NGRAM] * len(bridge.drafter_encode(word))
    assert kinds.count(KIND_DM) >= 4  # 'x', ' =', ' ', '1' style tokens map one to one
    if eos:
        assert kinds[-1] == KIND_DM and rows[-1] == len(emitted) - 1

    # to_example: positions index the drafter sequence, and carry the recorded rows' values
    k = 8
    n = len(emitted)
    prompt = tok.encode("Say hello.", add_special_tokens=False)
    record = _fake_record(bridge, prompt, emitted, k)
    preimages, _ = preimage_table(bridge)
    ex = to_example(record, bridge, preimages)
    context = bridge.target_to_drafter(prompt)
    assert ex.input_ids.tolist() == context + tokens
    dm_rows = [r for kk, r in zip(kinds, rows) if kk == KIND_DM]
    assert ex.dm_pos.tolist() == [len(context) + j for j, kk in enumerate(kinds) if kk == KIND_DM]
    assert torch.equal(ex.dm_logp_emitted, record.logp_emitted[dm_rows])
    assert ex.dm_topk.shape[:2] == (len(dm_rows), k)
    assert (bridge.d2t[ex.dm_topk[..., 0]] == record.topk_ids[dm_rows].long()).all()  # preimages map back
    ng_rows = [r for kk, r in zip(kinds, rows) if kk == KIND_NGRAM]
    assert word_row in ng_rows and torch.equal(ex.ng_logp_target, record.logp_emitted[ng_rows])
    assert ex.emitted_tokens == n


def _fake_record(bridge, prompt, emitted, k):
    from omnidraft.train.records import Record

    inter = torch.nonzero(bridge.t2d >= 0).flatten()
    n = len(emitted)
    return Record(prompt, emitted, inter[:k].repeat(n, 1).to(torch.int32), torch.full((n, k), -3.0),
                  torch.full((n,), -0.1), -torch.arange(1, n + 1, dtype=torch.float32))


@pytest.mark.real
def test_long_context_is_cut_on_the_left(bridge):
    tok = bridge.target_tokenizer
    prompt = tok.encode("word " * 400, add_special_tokens=False)
    emitted = tok.encode(" the end of it", add_special_tokens=False)
    preimages, _ = preimage_table(bridge)
    ex = to_example(_fake_record(bridge, prompt, emitted, 4), bridge, preimages, max_len=64)
    assert len(ex.input_ids) == 64
    tokens, kinds, _ = align(bridge, emitted)
    assert ex.input_ids[-len(tokens):].tolist() == tokens
    assert int(ex.dm_pos.max()) < 64 and int(ex.dm_pos.min()) >= 1
