"""The native drafter (``--drafter-backend native``): SmolLM2's GGUF blocks in one C++ forward per call.

It follows the fp32 torch drafter (the same Q4_1 weights, dequantized there) on nearly every top-1
token and within a small distance on every logit; reading a context in one call gives the bits of
reading it token by token (a long read, in float32 or on AMX tiles, comes within a small distance of
them); it takes the trainer's LoRA adapters with the logits torch + peft gives;
and greedy speculative decoding with it keeps the target's own output.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from conftest import DRAFTER, TEST_HOME, check_drop, greedy_with_backend, last_logits, long_document
from tiny import holding_costs

from omnidraft import kernels, models
from omnidraft.adapter.store import architecture_fingerprint, identity_of
from omnidraft.drafter import Drafter
from omnidraft.drafter.native_lm import NativeDraftLM, NativeUnsupported, load_native_model
from omnidraft.drafter.torch_lm import TorchDraftLM
from omnidraft.runtime import load_pipeline

TEXT = ("def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"
        "        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n"
        "        elif items[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n")


def test_the_native_drafter_is_built_where_the_cpu_can_run_it():
    """Set-up builds it (python -m omnidraft.kernels); without it `auto` silently loses its fastest drafter."""
    if kernels.unsupported_reason() is None and shutil.which("c++"):
        assert kernels.qdraft() is not None, f"no build under {kernels.build_dir('qdraft')}"
    elif kernels.unsupported_reason() is not None:
        assert kernels.qdraft() is None


@pytest.fixture(scope="module")
def native():
    if kernels.qdraft() is None:
        pytest.skip(f"the native drafter cannot run here: {kernels.unsupported_reason() or 'not built'}")
    tok = models.load_tokenizer(DRAFTER, TEST_HOME, progress=False)
    # the numerics tests compare whole logit rows; the pruned head has its own test
    return whole_head(load_native_model(models.gguf_of(DRAFTER, TEST_HOME, progress=False))), tok


def whole_head(weights) -> NativeDraftLM:
    """A native drafter whose steps take the whole LM head (the default takes the kept rows only)."""
    lm = NativeDraftLM(weights)
    lm.prune_head = False
    return lm


@contextmanager
def integer_reads() -> Iterator[None]:
    """Every read on the integer products (a long read otherwise takes float32 or AMX products)."""
    ext = kernels.qdraft()
    before = ext.long_read_rows(0)
    try:
        yield
    finally:
        ext.long_read_rows(before)


@pytest.mark.real
def test_reading_in_one_call_gives_the_bits_of_reading_token_by_token(native):
    lm, tok = native
    ids = list(tok.encode(TEXT))
    lm.apply_adapter(None)
    with integer_reads():
        read = lm.logits_for(ids[:30]).clone()
        hidden = lm.last_hidden.clone()
        lm.reset()
        lm.logits_for(ids[:1])
        for t in ids[1:30]:
            stepped = lm.step(t)
        assert torch.equal(stepped, read) and torch.equal(lm.last_hidden, hidden)
        again = lm.logits_for(ids[:12] + [ids[40]] + ids[13:30])  # a rollback to the common prefix, then a new branch
        assert lm.cached_ids == ids[:12] + [ids[40]] + ids[13:30] and not torch.equal(again, read)
        assert torch.equal(lm.logits_for(ids[:30]), read)
    assert read.shape == (lm.vocab_size,) and hidden.shape == (lm.hidden_size,) and hidden.abs().sum() > 0


@pytest.mark.real
def test_a_long_read_comes_within_a_small_distance_of_the_integer_products(native):
    """A read of many rows (a prompt) takes float32 products on dequantized weight tiles, and AMX tiles
    where the CPU has them: 2-3x faster than the integer products, which suit one row. Not their bits,
    but the same top token at the read and at every step after it, every logit within 0.1; and each
    path gives the same bits whatever the threads and however the rows are split into calls."""
    lm, tok = native
    ext = kernels.qdraft()
    ids = (list(tok.encode(TEXT)) * 4)[:120]
    lm.apply_adapter(None)

    def read_then_steps(pieces: list[int]) -> list[torch.Tensor]:  # 8 steps on the same tokens after the read
        lm.reset()
        start = 0
        for end in pieces:
            out = [lm.logits_for(ids[:end]).clone()]
            start = end
        assert start == len(ids) - 8
        return out + [lm.step(t).clone() for t in ids[start:]]

    with integer_reads():
        reference = read_then_steps([112])
    rows, amx_before = ext.long_reads()  # as the load's timing chose them
    paths = {"float32": False, **({"amx": True} if ext.use_amx(True) else {})}
    results = {}
    try:
        ext.long_read_rows(16)
        for name, amx in paths.items():
            assert ext.use_amx(amx) == amx
            results[name] = got = read_then_steps([112])
            assert not torch.equal(got[0], reference[0]), f"the {name} read took the integer products"
            for a, b in zip(got, reference):
                assert int(a.argmax()) == int(b.argmax()) and float((a - b).abs().max()) < 0.1, name
            assert all(torch.equal(a, b) for a, b in zip(read_then_steps([64, 112]), got)), name  # two calls
            threads, lm.n_threads = lm.n_threads, 1
            try:
                assert all(torch.equal(a, b) for a, b in zip(read_then_steps([112]), got)), name
            finally:
                lm.n_threads = threads
    finally:
        ext.long_read_rows(rows)
        ext.use_amx(amx_before)
    if "amx" in results:  # the tiles' three bfloat16 products follow float32, not one bfloat16 product
        assert not torch.equal(results["amx"][0], results["float32"][0])
        assert float((results["amx"][0] - results["float32"][0]).abs().max()) < 0.05


@pytest.mark.real
def test_the_vnni_products_give_the_bits_of_the_avx2_ones(native):
    """Where the CPU has AVX512-VNNI the products take it (Q4_1 layers, the Q8_0 LM head): the same
    integers, so the same logits."""
    lm, tok = native
    ext = kernels.qdraft()
    if not ext.use_vnni(True):
        pytest.skip("this CPU has no AVX512-VNNI")
    ids = list(tok.encode(TEXT))[:40]
    lm.apply_adapter(None)

    def logits() -> list[torch.Tensor]:  # reads of 37 rows (groups of 4, then 1) and of 3 more
        lm.reset()
        return [lm.logits_for(ids[:37]).clone(), lm.logits_for(ids).clone()]

    try:
        with integer_reads():
            vnni = logits()
            assert not ext.use_vnni(False)
            avx2 = logits()
    finally:
        ext.use_vnni(True)
    assert all(torch.equal(a, b) for a, b in zip(vnni, avx2)) and vnni[0].abs().sum() > 0


@pytest.mark.real
def test_a_context_read_in_pieces_leaves_what_one_read_leaves(native):
    """The streaming device reads a long prompt a piece at a time (``Drafter.read``), so that a stream
    that ends meanwhile waits for one piece; the draft after the pieces must be the one after one read."""
    lm, tok = native
    ids = (list(tok.encode(TEXT)) * 8)[:200]
    lm.apply_adapter(None)
    with integer_reads():  # the same products in the pieces as in the one read
        whole = lm.logits_for(ids).clone()
        lm.reset()
        drafter, left = Drafter(lm), []
        while n := drafter.read(ids, 2, 64):
            left.append(n)
            assert lm.cached_ids == ids[: len(ids) - n]  # each piece read on from the common prefix
        assert left == [136, 72, 8]  # the last 8 are left to the draft's own read
        assert torch.equal(lm.logits_for(ids), whole) and lm.cached_ids == ids


@pytest.mark.real
def test_the_drafter_is_timed_once_and_its_cache_left_on_the_context(native, real_models):
    """The streaming device times its drafter before the first draft (``ModelDraft.token_seconds``): the
    probe's steps must not stay in the cache, which keeps only a prefix of the context it reads next."""
    from omnidraft.decode import SpeculativeDecoder
    from omnidraft.runtime import build_bridge, encode_prompt
    from omnidraft.target import TorchTarget

    lm, _ = native
    lm.apply_adapter(None)
    lm.reset()
    d_model, d_tok = real_models(DRAFTER)
    t_model, t_tok = real_models("builtin:qwen2.5-coder-0.5b")
    decoder = SpeculativeDecoder(TorchTarget(t_model, t_tok), Drafter(lm), build_bridge(d_model, d_tok, t_model, t_tok))
    source, ids = decoder.source("drafter"), encode_prompt(t_tok, TEXT)
    seconds = source.token_seconds(ids)
    context = source._ctx.ids
    assert 0 < seconds < 10 and lm.cached_ids == context[:4]
    lm.logits_for(context[:10])
    assert source.token_seconds(ids) == seconds and lm.cached_ids == context[:10]  # timed once


@pytest.mark.real
def test_it_follows_the_fp32_torch_drafter(native, real_models):
    lm, tok = native
    model, _ = real_models(DRAFTER)
    ref = TorchDraftLM(model, "float32")
    ids = list(tok.encode(TEXT))
    lm.apply_adapter(None)
    lm.reset()
    ref.reset()
    same = total = 0
    worst = 0.0
    for i in range(8, len(ids)):
        a, b = lm.logits_for(ids[:i]), ref.logits_for(ids[:i])
        same += int(a.argmax() == b.argmax())
        total += 1
        worst = max(worst, float((a - b).abs().max()))
    assert lm.vocab_size == ref.vocab_size and lm.hidden_size == ref.hidden_size
    assert same / total >= 0.98, f"top-1 agreement {same}/{total}"
    assert worst < 0.1, f"largest logit difference {worst:.3f}"  # logits span about +-30
    assert torch.allclose(lm.last_hidden, ref.last_hidden, atol=0.05, rtol=0)


@pytest.mark.real
def test_an_adapter_gives_the_logits_of_torch_and_peft(native, peft_drafter):
    lm, tok = native
    peft, state, scaling = peft_drafter
    ids = list(tok.encode(TEXT))[:40]
    with peft.disable_adapter():
        base_torch = last_logits(peft, ids)
    adapted_torch = last_logits(peft, ids)
    lm.apply_adapter(None)
    base = lm.logits_for(ids).clone()
    lm.apply_adapter(state, scaling)
    adapted = lm.logits_for(ids).clone()
    shift = (adapted_torch - base_torch).abs().max()
    gap = (adapted_torch - adapted).abs().max()
    assert shift > 2.0, "the adapter must move the logits far"
    assert gap < 0.1, f"with the adapter the native logits are {gap:.3f} from torch + peft"
    lm.apply_adapter(None)  # back to the base weights, exactly
    assert torch.equal(lm.logits_for(ids), base)


@pytest.mark.real
def test_a_misfit_adapter_is_refused_and_a_fork_carries_the_adapter(native, peft_drafter):
    lm, tok = native
    _, state, scaling = peft_drafter
    ids = list(tok.encode(TEXT))
    lm.apply_adapter(state, scaling)
    adapted = lm.logits_for(ids[:30]).clone()
    key = next(k for k in state if k.endswith("q_proj.lora_A.weight"))
    with pytest.raises(ValueError, match="do not fit"):  # another drafter's shapes: nothing changes
        lm.apply_adapter({**state, key: torch.zeros(8, 7)}, scaling)
    lm.reset()
    assert torch.equal(lm.logits_for(ids[:30]), adapted)
    other = lm.fork()
    try:
        lm.reset()
        lm.logits_for(ids[:10])
        assert torch.equal(other.logits_for(ids[:30]), adapted)  # same weights, same adapter
        assert lm.cached_ids == ids[:10] and other.cached_ids == ids[:30]  # caches of their own
        lm.apply_adapter(None)
        other.reset()  # read again as `adapted` was read: one call of 30 rows
        assert torch.equal(other.logits_for(ids[:30]), adapted)  # an adapter is per instance
    finally:
        lm.apply_adapter(None)


def _base_and_adapted(native, peft_drafter):
    """(lm, state, scaling, ids, base logits, adapted logits): the native drafter left on the adapter."""
    lm, tok = native
    _, state, scaling = peft_drafter
    ids = list(tok.encode(TEXT))[:30]
    lm.apply_adapter(None)
    base = lm.logits_for(ids).clone()
    lm.apply_adapter(state, scaling)
    return lm, state, scaling, ids, base, lm.logits_for(ids).clone()


@pytest.mark.real
def test_switching_to_the_base_weights_and_back_is_a_swap_that_gives_the_same_logits(native, peft_drafter):
    """The weights choice alternates an adapter and the base weights draft by draft: the way back to
    the adapter set aside must give its logits bit for bit, and another adapter replaces it."""
    lm, state, scaling, ids, base, adapted = _base_and_adapted(native, peft_drafter)
    assert not torch.equal(base, adapted)
    assert lm.cheap_adapter_switch
    try:
        for _ in range(2):
            lm.apply_adapter(None)
            assert lm._stashed is not None and torch.equal(lm.logits_for(ids), base)
            lm.apply_adapter(state, scaling)  # the same state: swapped back, not converted
            assert lm._stashed is None and torch.equal(lm.logits_for(ids), adapted)
        halved = {k: v / 2 if "lora_B" in k else v for k, v in state.items()}
        lm.apply_adapter(None)
        lm.apply_adapter(halved, scaling)  # another adapter: converted, and the one set aside dropped
        other = lm.logits_for(ids).clone()
        assert lm._stashed is None and not torch.equal(other, adapted) and not torch.equal(other, base)
        lm.apply_adapter(state, 2 * scaling)  # the same tensors at another scaling are other weights
        assert not torch.equal(lm.logits_for(ids), adapted)
    finally:
        lm.apply_adapter(None)


@pytest.mark.real
def test_the_kept_index_of_the_gguf_loads_the_same_weights(native, tmp_path):
    """A later process reads the GGUF's tensors through the index the first one kept (parsing every
    field takes seconds); the logits must be the bits of a load that parsed the file, and a damaged
    index must be read again, not trusted."""
    lm, tok = native
    gguf = models.gguf_of(DRAFTER, TEST_HOME, progress=False)
    ids = list(tok.encode(TEXT))[:24]
    lm.apply_adapter(None)
    lm.reset()
    parsed = lm.logits_for(ids).clone()
    index_dir = tmp_path / "gguf-index"
    first = whole_head(load_native_model(gguf, index_dir))
    kept = list(index_dir.glob("*.json"))
    assert len(kept) == 1
    from_index = whole_head(load_native_model(gguf, index_dir))
    assert torch.equal(first.logits_for(ids), parsed) and torch.equal(from_index.logits_for(ids), parsed)
    kept[0].write_text("{not json")
    assert torch.equal(whole_head(load_native_model(gguf, index_dir)).logits_for(ids), parsed)
    assert '"tensors"' in kept[0].read_text()  # written again whole


def test_a_gguf_it_cannot_run_is_refused_with_the_reason():
    if kernels.qdraft() is None:
        pytest.skip("the native drafter cannot run here")
    with pytest.raises(NativeUnsupported, match="llama-architecture"):
        load_native_model(models.gguf_of("builtin:qwen2.5-coder-0.5b", TEST_HOME, progress=False))


@pytest.mark.real
def test_greedy_with_the_native_drafter_is_the_targets_own_output(native, real_models):
    lm, _ = native
    lm.apply_adapter(None)
    got, plain, stats = greedy_with_backend(lm, real_models)
    assert got == plain
    assert stats.proposed_tokens > 0 and stats.accepted_tokens > 0


@pytest.mark.real
def test_the_pipeline_loads_it_without_the_torch_drafter_and_uses_the_pairs_adapter(tmp_path, native, peft_drafter,
                                                                                      real_models):
    from omnidraft.train.publish import save

    peft, state, _ = peft_drafter
    d_model, d_tok = real_models(DRAFTER)
    _, t_tok = real_models("builtin:gemma3-270m")
    save(tmp_path / "adapter", peft, {"identity": vars(identity_of(d_tok, t_tok, d_model)), "updates": 1})
    pipe = load_pipeline("builtin:gemma3-270m", DRAFTER, home=TEST_HOME, quiet=True, adapter=str(tmp_path / "adapter"),
                         drafter_backend="native")
    assert isinstance(pipe.decoder.drafter.lm, NativeDraftLM) and pipe.drafter_model is None
    assert pipe.drafter_backend == "native"
    assert pipe.adapter_slot.identity.drafter_arch == architecture_fingerprint(d_model)  # without loading it
    assert pipe.adapter_slot.current is not None and pipe.adapter_slot.current.state.keys() == state.keys()


@pytest.mark.real
def test_the_bench_base_drafter_drops_the_adapter_and_leaves_the_original_adapted(native, peft_drafter):
    """`bench --modes greedy,greedy-base` compares an adapter with the base weights in one run: the
    base mode's drafter must draft with the base weights and no acceptance head, while the adapted
    drafter it was forked from keeps its adapter."""
    from omnidraft.bench.runner import without_adapter
    from omnidraft.drafter import Drafter

    lm, state, scaling, ids, base, adapted = _base_and_adapted(native, peft_drafter)
    try:
        drafter = Drafter(lm, stop_ids=[0])
        drafter.head = object()  # an adapter's acceptance head: not the base mode's
        plain = without_adapter(drafter)
        assert plain.head is None and plain.stop_ids == drafter.stop_ids and plain.lm is not lm
        assert torch.equal(plain.lm.logits_for(ids), base)
        lm.reset()
        assert torch.equal(lm.logits_for(ids), adapted)
    finally:
        lm.apply_adapter(None)


@pytest.fixture(scope="module")
def long_text(native):
    _, tok = native
    return long_document(tok)


@pytest.mark.real
def test_dropped_positions_leave_the_rest_rotated_into_place(native, long_text):
    """``drop`` (a sliding window without a re-read) on the native cache: see ``check_drop``."""
    lm, _ = native
    lm.apply_adapter(None)
    check_drop(lm, long_text)


@pytest.mark.real
def test_a_window_that_slides_reads_only_the_new_tokens(native, long_text):
    """Past ``DRAFT_WINDOW`` the drafter keeps the first tokens and a recent part; when that part moves
    on, a drafter that can drop positions reads only what is new instead of the whole window again."""
    from omnidraft.drafter.drafter import DRAFT_WINDOW, SINK
    from omnidraft.drafter.policy import DraftPolicy, FixedLength, Sampler
    from omnidraft.vocab.translate import FixedConstraint

    lm, tok = native
    lm.apply_adapter(None)
    lm.reset()
    drafter = Drafter(lm)
    policy = DraftPolicy(Sampler(), FixedConstraint(torch.zeros(lm.vocab_size)), FixedLength())
    first = drafter.draft(long_text[:900], 4, policy)
    assert first.read_tokens == 900  # no slide yet
    context = long_text[:DRAFT_WINDOW + 100]
    window = drafter.window(context, 4)
    assert window[:SINK] == context[:SINK] and len(window) < DRAFT_WINDOW and window[-1] == context[-1]
    assert all(drafter.window(context, k) == window for k in (1, 8, 16))  # k varies per draft: the window must not
    second = drafter.draft(context, 4, policy)
    assert second.read_tokens <= len(context) - 900 + 8 and lm.cached_ids[: len(window)] == list(window)


@pytest.mark.real
def test_a_long_catch_up_behind_a_long_cache_reads_only_its_last_part(native, long_text):
    """A catch-up of more than ``CATCH_UP_CAP`` tokens behind a cache holding at least that many reads
    only the last ``CATCH_UP_CAP`` (the window then starts there); the next draft reads only what is
    new; a first read and an idle-time read (``cap=False``) read everything; a new text lifts the cap."""
    from omnidraft.drafter.drafter import CATCH_UP_CAP, SINK
    from omnidraft.drafter.policy import DraftPolicy, FixedLength, Sampler
    from omnidraft.vocab.translate import FixedConstraint

    lm, _ = native
    lm.apply_adapter(None)
    lm.reset()
    drafter = Drafter(lm)
    policy = DraftPolicy(Sampler(), FixedConstraint(torch.zeros(lm.vocab_size)), FixedLength())
    assert drafter.draft(long_text[:400], 1, policy).read_tokens == 400  # a first read is not capped
    assert drafter.unread(800, 1) == CATCH_UP_CAP  # what the offers are told
    capped = drafter.draft(long_text[:800], 1, policy)
    assert capped.read_tokens == CATCH_UP_CAP
    assert list(capped.context) == long_text[:SINK] + long_text[800 - CATCH_UP_CAP:800]
    assert lm.cached_ids[: len(capped.context)] == list(capped.context)
    after = drafter.draft(long_text[:830], 1, policy)  # the window keeps its new start: 30 new tokens
    assert after.read_tokens <= 31 and list(after.context) == long_text[:SINK] + long_text[800 - CATCH_UP_CAP:830]
    # a text that departs from it lifts the cap: the whole new text is read, as a first read is
    fresh = long_text[500:1100]
    assert drafter.draft(fresh, 1, policy).context == fresh
    lm.reset()
    drafter.draft(long_text[:400], 1, policy)
    while drafter.read(long_text[:800], 1, 64, cap=False):  # idle time: the whole window, in pieces
        pass
    assert drafter.draft(long_text[:800], 1, policy).read_tokens <= 64 and lm.cached_ids[:800] == long_text[:800]
    # new text longer than what the window keeps of it: nothing of the window is cached, still capped
    lm.reset()
    drafter = Drafter(lm)
    drafter.draft(long_text[:400], 1, policy)
    assert len(drafter.window(long_text, 1)) < len(long_text) - 400  # the window slid past the cache
    assert drafter.draft(long_text, 1, policy).read_tokens == CATCH_UP_CAP


@pytest.mark.real
def test_a_text_rewritten_before_the_cache_reads_only_what_is_new(native, long_text):
    """A chat that dropped its oldest turns to fit the target's context: the drafter finds its cached
    text again in the rewritten one (past the tokens its last draft added, which the text does not
    have, and before a seam where the text was tokenized otherwise), drops the cached tokens the text
    lost and reads only the new message, whether its window began at the text's start or had slid; a
    text without the cached part is read whole."""
    from omnidraft.drafter.drafter import SINK
    from omnidraft.drafter.policy import DraftPolicy, FixedLength, Sampler
    from omnidraft.vocab.translate import FixedConstraint

    lm, _ = native
    lm.apply_adapter(None)
    lm.reset()
    drafter = Drafter(lm)
    policy = DraftPolicy(Sampler(), FixedConstraint(torch.zeros(lm.vocab_size)), FixedLength())
    assert len(drafter.draft(long_text[:600], 4, policy).tokens) == 4  # the cache now ends in 3 drafted tokens
    rewritten = long_text[:20] + long_text[300:640]  # tokens 20-299 gone (the oldest turns), 40 new ones
    after = drafter.draft(rewritten, 1, policy)
    assert after.read_tokens <= 40 and list(after.context) == rewritten  # the start both share is kept too
    assert lm.cached_ids[: len(rewritten)] == rewritten
    # a seam: the same text tokenized otherwise where the conversation was rendered again (one cached
    # token is two others now); the cache is found before the seam, and the read starts at the seam
    lm.reset()
    drafter = Drafter(lm)
    drafter.draft(long_text[:600], 4, policy)
    seam = [t for t in (100, 101, 102) if t != long_text[560]][:2]
    rewritten = long_text[:20] + long_text[300:560] + seam + long_text[561:640]
    after = drafter.draft(rewritten, 1, policy)
    assert after.read_tokens == 2 + (640 - 561) and list(after.context) == rewritten
    assert lm.cached_ids[: len(rewritten)] == rewritten
    # a window that had slid (the sinks and a recent part cached): it starts where the cached part now is
    lm.reset()
    drafter = Drafter(lm)
    slid = drafter.draft(long_text[:1100], 1, policy)
    assert slid.context[SINK] != long_text[SINK]
    rewritten = long_text[:20] + long_text[700:1130]
    after = drafter.draft(rewritten, 1, policy)
    assert after.read_tokens == 30 and list(after.context) == long_text[:SINK] + long_text[700:1130]
    assert lm.cached_ids[: len(after.context)] == list(after.context)
    # the cached part is not in the new text: all of it is read
    other = long_text[:SINK] + long_text[1200:1400]
    assert drafter.draft(other, 1, policy).read_tokens == len(other) - SINK


@pytest.mark.real
def test_the_weights_choice_runs_the_adapter_then_the_base_weights_and_keeps_the_targets_output(tmp_path, native,
                                                                                                peft_drafter, real_models):
    """The real pair with an adapter in the pipeline: on the native drafter a switch is a swap, so the
    first requests are paired trials, the adapter and the base weights drafting in turn on the same
    text; every request gives the target's own greedy output. The bench's fork for its greedy mode
    switches its own weights and leaves the pipeline's drafter adapted."""
    from omnidraft.adapter.store import BASE_WEIGHTS
    from omnidraft.bench.runner import weights_choice_slot
    from omnidraft.config import DecodeConfig
    from omnidraft.costs import DraftCost, VerifyCosts
    from omnidraft.decode import SpeculativeDecoder
    from omnidraft.runtime import encode_prompt
    from omnidraft.train.publish import save

    peft, _, _ = peft_drafter
    d_model, d_tok = real_models(DRAFTER)
    _, t_tok = real_models("builtin:gemma3-270m")
    save(tmp_path / "adapter", peft, {"identity": vars(identity_of(d_tok, t_tok, d_model)), "updates": 1})
    home = tmp_path / "home"  # the session's models, and a policy file of this test's own
    (home / "models").mkdir(parents=True)
    for entry in (TEST_HOME / "models").iterdir():
        if entry.name != "costs":
            (home / "models" / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    pipe = load_pipeline("builtin:gemma3-270m", DRAFTER, home=home, quiet=True,
                         adapter=str(tmp_path / "adapter"), drafter_backend="native")
    slot, decoder = pipe.adapter_slot, pipe.decoder
    prompt = encode_prompt(pipe.target_tokenizer, "Write a Python function that reverses a list.")
    config = DecodeConfig(max_new_tokens=24)
    alone = SpeculativeDecoder(decoder.target).generate(prompt, DecodeConfig(max_new_tokens=24, lookup=False))
    assert slot.alternates
    policy = decoder.cost_policy  # costs at which drafting pays, held whatever this host's speed
    policy.verify_costs = VerifyCosts({0: 0.050, 1: 0.052, 2: 0.054, 4: 0.058, 8: 0.066})
    policy.draft_cost, policy.read_cost = DraftCost(0.0005), DraftCost(0.0001)
    holding_costs(policy)
    for _ in range(2):
        assert decoder.generate(prompt, config).token_ids == alone.token_ids
    trials = policy.weights_choice.trials
    assert trials is not None and trials.adapter == slot.adapter_weights and slot.current is not None
    assert set(trials.tally) == {slot.adapter_weights, BASE_WEIGHTS}  # both drafted, in turn
    assert policy.weights_choice.picks.get("paired", 0) >= 1
    assert set(policy.shelf) | {policy.weights} == {slot.adapter_weights, BASE_WEIGHTS}  # each its own evidence
    fork = weights_choice_slot(slot)
    assert fork is not None and fork.drafter.lm is not slot.drafter.lm
    fork.run(BASE_WEIGHTS)
    slot.run(slot.adapter_weights)
    ids = list(d_tok.encode(TEXT))[:30]
    assert not torch.equal(fork.drafter.lm.logits_for(ids), slot.drafter.lm.logits_for(ids))
    # the bench: greedy and greedy@llamacpp each choose their weights on a fork of their own, and each
    # gives the target's own greedy output on its engine
    from omnidraft.bench.runner import build_modes, policy_report
    from omnidraft.target.llamacpp import LlamaCppTarget

    llama = LlamaCppTarget(models.gguf_of("builtin:gemma3-270m", home, progress=False), t_tok, n_ctx=1024)
    try:
        fns = build_modes(pipe, ["greedy", "greedy@llamacpp"], config, 0.0, llama=llama,
                          choosing=lambda: weights_choice_slot(slot))
        switches = [fns[m].decoder.cost_policy.switch for m in ("greedy", "greedy@llamacpp")]
        assert all(s is not None for s in switches) and switches[0] is not switches[1]
        assert switches[0].drafter.lm is not switches[1].drafter.lm
        on_llama = SpeculativeDecoder(llama).generate(prompt, DecodeConfig(max_new_tokens=24, lookup=False))
        for _ in range(3):
            assert fns["greedy"](prompt).token_ids == alone.token_ids
            assert fns["greedy@llamacpp"](prompt).token_ids == on_llama.token_ids
        report = policy_report(fns)
        for mode in ("greedy", "greedy@llamacpp"):  # the first request measures; each later one is chosen
            picks = report[mode]["weights_requests"]
            assert sum(picks.values()) == 2 and picks.get("paired", 0) >= 1, (mode, picks)
        assert slot.weights == slot.adapter_weights  # the pipeline's own slot kept its adapter
    finally:
        llama.close()


@pytest.mark.real
def test_a_pruned_head_gives_the_whole_heads_logits_on_its_kept_rows_and_takes_in_every_token_read(native):
    """Steps take the head's kept rows only (``HeadVocab``): their logits are the whole head's bits, the rest
    -inf. A token read for the first time has its row kept from that read on, in every fork."""
    whole, tok = native
    whole.apply_adapter(None)
    vocab = whole.weights.head_vocab
    lm = whole.fork()
    lm.prune_head = True  # the default (the fixture's steps take the whole head)
    ids = list(tok.encode(TEXT))
    rare = next(t for t in range(lm.vocab_size - 1, 0, -1) if not vocab.kept[t])  # a token no test has read
    assert vocab.kept[: lm.vocab_size // 3].all() and not vocab.kept.all()
    lm.reset()
    whole.reset()
    for context in (ids[:20], ids[:20] + [rare]):
        pruned, full = lm.logits_for(context), whole.logits_for(context)
        kept = torch.from_numpy(vocab.kept.copy())
        assert kept[context].all()  # what was read is kept (the rare token from its read on)
        assert torch.equal(pruned[kept], full[kept]) and torch.isneginf(pruned[~kept]).all()
        assert torch.isfinite(full).all() and int(pruned.argmax()) == int(full.masked_fill(~kept, float("-inf")).argmax())
    assert vocab.kept[rare]
    other = lm.fork()  # another session over the same weights: the same kept rows
    a, b = other.logits_for(ids[:20] + [rare]), lm.logits_for(ids[:20] + [rare])
    assert other.prune_head and torch.equal(torch.isneginf(a), torch.isneginf(b)) and bool(torch.isfinite(a[rare]))


def test_the_kept_head_rows_are_kept_in_the_home_and_a_file_that_does_not_fit_is_ignored(tmp_path, capsys):
    """``HeadVocab.keep_at`` / ``save``: what a home has read stays kept in the next process; a file of another
    vocabulary, or none, starts from the first third of the ids; a home that cannot be written is a warning."""
    from omnidraft.drafter.native_lm import HeadVocab

    path = tmp_path / "costs" / "head-rows.bits"
    first = HeadVocab(None, 100)
    first.keep_at(path)
    assert first.kept.sum() == 33 and not path.exists()
    first.add([90, 95, 2])
    for bad in ([-1], [100], [3, 100]):  # numpy would keep -1 as 99
        with pytest.raises(ValueError, match="out of range"):
            first.add(bad)
    first.save()
    again = HeadVocab(None, 100)
    again.keep_at(path)
    assert (again.kept == first.kept).all() and again.kept[[90, 95]].all() and again.kept.sum() == 35
    other = HeadVocab(None, 200)  # another drafter's vocabulary
    other.keep_at(path)
    assert other.kept.sum() == 66
    before = path.read_bytes()
    again.save()  # nothing grew: nothing written
    assert path.read_bytes() == before
    (tmp_path / "a-file").write_text("")
    for where in (tmp_path / "a-file" / "head-rows.bits", tmp_path / "a-folder"):  # no folder; a folder in its place
        (tmp_path / "a-folder").mkdir(exist_ok=True)
        stuck = HeadVocab(None, 100)
        stuck.keep_at(where)
        stuck.add([99])
        stuck.save()  # one line, no error
        assert "could not keep the drafter's head rows" in capsys.readouterr().err


def test_a_vocabulary_with_a_shipped_set_starts_from_it_and_one_without_from_the_first_third(tmp_path, monkeypatch):
    """``shipped_base``: the set under ``head_rows/`` named by the vocabulary's key is a fresh home's base; no
    file, a file of another size, or a GGUF without a token list falls back to the first third."""
    from omnidraft.drafter import native_lm
    from omnidraft.drafter.native_lm import HeadVocab, head_rows_file, shipped_base, vocab_key

    monkeypatch.setattr(native_lm, "HEAD_ROWS_DIR", tmp_path)
    key = vocab_key([b"a", b"bc"])
    assert key != vocab_key([b"ab", b"c"]) and key != vocab_key([b"a", b"bc", b""])  # lengths are part of it
    assert shipped_base(key, 100) is None and shipped_base("", 100) is None
    wanted = np.zeros(100, dtype=bool)
    wanted[[0, 5, 60, 99]] = True
    head_rows_file(key).write_bytes(np.packbits(wanted).tobytes())
    base = shipped_base(key, 100)
    assert base is not None and (base == wanted).all()
    assert shipped_base(key, 200) is None  # another vocabulary's size
    vocab = HeadVocab(None, 100, base)
    assert vocab.kept.sum() == 4 and vocab.kept[99] and not vocab.kept[1]
    vocab.add([1])
    assert not base[1]  # the set grows on a copy: the shipped mask stays as read
    with pytest.raises(ValueError, match="a base of"):
        HeadVocab(None, 50, base)


def test_the_builtin_drafter_ships_a_set_that_keeps_common_late_merged_words(native):
    """The builtin drafter's GGUF names its vocabulary, a set ships for it (so a wheel must carry it), and that
    set keeps the first third of the ids and common words it misses ("tuple", " TODO"), for a few percent more rows."""
    from omnidraft.drafter.native_lm import head_rows_file, shipped_base

    lm, tok = native
    weights = lm.weights
    assert len(weights.vocab_key) == 64 and head_rows_file(weights.vocab_key).exists()
    kept, fresh = weights.head_vocab.kept, shipped_base(weights.vocab_key, weights.vocab_size)
    third = weights.vocab_size // 3
    assert fresh is not None and fresh[:third].all() and third < fresh.sum() < 1.1 * third
    for word in ("tuple", " TODO"):
        (late,) = tok.encode(word)
        assert late >= third and fresh[late] and kept[late]


def test_the_long_reads_are_chosen_by_timing_them_once_per_process(native):
    """Which products a long read takes is timed at the first load (no CPU is assumed to favour one)."""
    from omnidraft.drafter import native_lm

    ext = kernels.qdraft()
    chosen = native_lm.chosen_long_reads()
    assert chosen is not None and chosen.split()[0] in ("integer", "float32", "amx") and "integer" in chosen
    rows, amx = ext.long_reads()
    assert (rows == 0) == chosen.startswith("integer") and amx == chosen.startswith("amx")
    lm, _ = native
    assert native_lm.choose_long_reads(lm.weights.model, lm.vocab_size) is chosen  # not timed again


def test_a_rebuilt_native_kernel_has_the_pairs_drafting_costs_measured_again(native):
    """A policy's costs are kept per machine string (CPU, torch, kernels); the native drafter's own build
    is part of it, so a kernel that reads faster is not planned with the old kernel's read costs."""
    from omnidraft.runtime import cost_machine, policy_machine

    assert kernels.build_dir("qdraft").name in policy_machine("native")
    assert kernels.build_dir("qdraft").name not in cost_machine()  # the target's kernel choices stay kept
    assert policy_machine("llamacpp") == cost_machine()
