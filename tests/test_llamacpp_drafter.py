"""The drafter on llama.cpp (``--drafter-backend llamacpp``): SmolLM2's shipped GGUF in-process.

Its cache follows a token list like the other backends (a step equals reading the longer list; a
rollback equals a fresh read), it agrees with the fp32 torch drafter (the same Q4_1 weights,
dequantized there) on nearly every greedy token, it takes the trainer's LoRA adapters as GGUF LoRA
with the logits torch + peft gives on the same adapter, and greedy speculative decoding with it
keeps the target's own output.
"""

from __future__ import annotations


import pytest
import torch
from conftest import DRAFTER, TEST_HOME, check_drop, greedy_with_backend, last_logits, long_document

from omnidraft import models
from omnidraft.adapter import gguf_lora
from omnidraft.adapter.store import architecture_fingerprint, identity_of
from omnidraft.drafter.llamacpp_lm import LlamaCppDraftLM
from omnidraft.drafter.torch_lm import TorchDraftLM
from omnidraft.errors import OmnidraftError
from omnidraft.runtime import load_pipeline

TEXT = ("def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"
        "        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n")


@pytest.fixture(scope="module")
def gguf_lm():
    tok = models.load_tokenizer(DRAFTER, TEST_HOME, progress=False)
    lm = LlamaCppDraftLM(models.gguf_of(DRAFTER, TEST_HOME, progress=False), tok)
    yield lm, tok
    lm.engine.close()


@pytest.mark.real
def test_the_cache_follows_the_token_list(gguf_lm):
    lm, tok = gguf_lm
    ids = list(tok.encode(TEXT))
    lm.reset()
    first = lm.logits_for(ids[:20])
    stepped = [lm.step(t) for t in ids[20:26]]
    assert lm.cached_ids == ids[:26]
    lm.reset()
    fresh = lm.logits_for(ids[:26])
    assert torch.equal(stepped[-1].argmax(), fresh.argmax())
    assert torch.allclose(stepped[-1], fresh, atol=0.05, rtol=0)  # one-token vs batched kernels
    again = lm.logits_for(ids[:20])  # a rollback: the cache keeps the common prefix
    assert lm.cached_ids == ids[:20] and torch.allclose(again, first, atol=0.05, rtol=0)
    assert first.shape == (lm.vocab_size,) and lm.last_hidden.shape == (lm.hidden_size,)
    assert torch.isfinite(lm.last_hidden).all() and lm.last_hidden.abs().sum() > 0


@pytest.mark.real
def test_dropped_positions_leave_the_rest_rotated_into_place(gguf_lm):
    """``drop`` (a sliding window without a re-read) on llama.cpp's cache: see ``check_drop``."""
    lm, tok = gguf_lm
    check_drop(lm, long_document(tok))
    lm.reset()


@pytest.mark.real
def test_it_agrees_with_the_fp32_torch_drafter(gguf_lm, real_models):
    lm, tok = gguf_lm
    model, _ = real_models(DRAFTER)
    ref = TorchDraftLM(model, "float32")
    ids = list(tok.encode(TEXT))
    lm.reset()
    ref.reset()
    same = total = 0
    for i in range(8, len(ids)):
        a, b = lm.logits_for(ids[:i]), ref.logits_for(ids[:i])
        same += int(a.argmax() == b.argmax())
        total += 1
    assert lm.vocab_size == ref.vocab_size and lm.hidden_size == ref.hidden_size
    assert same / total >= 0.9, f"top-1 agreement {same}/{total}"


@pytest.mark.real
def test_a_gguf_lora_gives_the_logits_of_torch_and_peft(gguf_lm, peft_drafter):
    lm, tok = gguf_lm
    peft, state, scaling = peft_drafter
    ids = list(tok.encode(TEXT))[:40]
    with peft.disable_adapter():
        base_torch = last_logits(peft, ids)
    adapted_torch = last_logits(peft, ids)
    lm.apply_adapter(None)
    lm.reset()
    base_gguf = lm.logits_for(ids).clone()
    lm.apply_adapter(state, scaling)
    lm.reset()
    adapted_gguf = lm.logits_for(ids).clone()
    quantization_gap = (base_torch - base_gguf).abs().max()
    shift = (adapted_torch - base_torch).abs().max()
    assert shift > 8 * quantization_gap, "the adapter must move the logits far more than the backends differ"
    gap = (adapted_torch - adapted_gguf).abs().max()
    assert gap < 2 * quantization_gap, f"with the adapter: {gap:.3f}, base weights: {quantization_gap:.3f}"
    assert adapted_gguf.argmax() == adapted_torch.argmax()
    lm.apply_adapter(None)  # back to the base weights, exactly
    lm.reset()
    assert torch.equal(lm.logits_for(ids), base_gguf)


@pytest.mark.real
def test_without_the_q_k_row_permutation_the_adapter_lands_on_the_wrong_rows(gguf_lm, peft_drafter, monkeypatch):
    lm, tok = gguf_lm
    peft, state, scaling = peft_drafter
    ids = list(tok.encode(TEXT))[:40]
    adapted_torch = last_logits(peft, ids)
    lm.apply_adapter(state, scaling)
    lm.reset()
    right = (lm.logits_for(ids) - adapted_torch).abs().max()
    monkeypatch.setattr(gguf_lora, "ROPE_PERMUTED", frozenset())
    lm.apply_adapter(state, scaling)
    lm.reset()
    wrong = (lm.logits_for(ids) - adapted_torch).abs().max()
    lm.apply_adapter(None)
    assert wrong > 2 * right, (float(wrong), float(right))


@pytest.mark.real
def test_a_misfit_adapter_is_refused_and_a_fork_carries_the_adapter(gguf_lm, peft_drafter):
    lm, tok = gguf_lm
    _, state, scaling = peft_drafter
    ids = list(tok.encode(TEXT))
    lm.apply_adapter(state, scaling)
    lm.reset()
    adapted = lm.logits_for(ids[:30]).clone()
    key = next(k for k in state if k.endswith("q_proj.lora_A.weight"))
    with pytest.raises(ValueError):  # another drafter's shapes: llama.cpp refuses it, nothing changes
        lm.apply_adapter({**state, key: torch.zeros(8, 7)}, scaling)
    lm.reset()
    assert torch.equal(lm.logits_for(ids[:30]), adapted)
    other = lm.fork()
    try:
        lm.reset()
        lm.logits_for(ids[:10])
        assert torch.equal(other.logits_for(ids[:30]), adapted)  # same weights, same adapter
        assert lm.cached_ids == ids[:10] and other.cached_ids == ids[:30]  # caches of their own
    finally:
        other.engine.close()
        lm.apply_adapter(None)


@pytest.mark.real
def test_greedy_with_the_gguf_drafter_is_the_targets_own_output(gguf_lm, real_models):
    lm, _ = gguf_lm
    got, plain, stats = greedy_with_backend(lm, real_models)
    assert got == plain
    assert stats.proposed_tokens > 0 and stats.accepted_tokens > 0


@pytest.mark.real
def test_the_pipeline_loads_it_without_the_torch_drafter_and_uses_the_pairs_adapter(tmp_path, peft_drafter,
                                                                                      real_models):
    from omnidraft.train.publish import save

    peft, state, _ = peft_drafter
    d_model, d_tok = real_models(DRAFTER)
    _, t_tok = real_models("builtin:gemma3-270m")
    identity = identity_of(d_tok, t_tok, d_model)
    save(tmp_path / "adapter", peft, {"identity": vars(identity), "updates": 1})
    with pytest.raises(OmnidraftError, match="no adapter folder"):
        load_pipeline("builtin:gemma3-270m", DRAFTER, home=TEST_HOME, quiet=True, adapter=str(tmp_path / "nowhere"),
                      drafter_backend="llamacpp")
    pipe = load_pipeline("builtin:gemma3-270m", DRAFTER, home=TEST_HOME, quiet=True, adapter=str(tmp_path / "adapter"),
                         drafter_backend="llamacpp")
    try:
        assert isinstance(pipe.decoder.drafter.lm, LlamaCppDraftLM) and pipe.drafter_model is None
        assert pipe.adapter_slot.identity.drafter_arch == architecture_fingerprint(d_model)  # without loading it
        assert pipe.adapter_slot.current is not None and pipe.adapter_slot.current.state.keys() == state.keys()
    finally:
        pipe.decoder.drafter.lm.engine.close()


@pytest.mark.real
def test_the_benchs_gguf_mode_drafts_with_the_runs_adapter(tmp_path, gguf_lm, peft_drafter, real_models):
    """`bench --adapter X` with a -gguf mode: that mode's drafter carries X like the pipeline's
    (it once ran the base weights, so a trained adapter looked like no gain there)."""
    import argparse

    from omnidraft.cli.bench import _gguf_drafter
    from omnidraft.train.publish import save

    lm, tok = gguf_lm
    peft, _, _ = peft_drafter
    d_model, d_tok = real_models(DRAFTER)
    _, t_tok = real_models("builtin:gemma3-270m")
    save(tmp_path / "adapter", peft, {"identity": vars(identity_of(d_tok, t_tok, d_model)), "updates": 1})
    ids = list(tok.encode(TEXT))[:40]
    lm.apply_adapter(None)
    lm.reset()
    base = lm.logits_for(ids).clone()
    for adapter, moved in (("none", False), (str(tmp_path / "adapter"), True)):
        pipe = load_pipeline("builtin:gemma3-270m", DRAFTER, home=TEST_HOME, quiet=True, adapter=adapter,
                             drafter_backend="llamacpp")
        bench_drafter = _gguf_drafter(argparse.Namespace(drafter=DRAFTER), pipe)
        try:
            got = bench_drafter.lm.logits_for(ids)
            assert (got - base).abs().max() > 1.0 if moved else torch.allclose(got, base, atol=0.05, rtol=0)
        finally:
            bench_drafter.lm.engine.close()
            pipe.decoder.drafter.lm.engine.close()
