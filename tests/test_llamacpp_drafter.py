"""The drafter on llama.cpp (``--drafter-backend llamacpp``): SmolLM2's shipped GGUF in-process.

Its cache follows a token list like the other backends (a step equals reading the longer list; a
rollback equals a fresh read), it agrees with the fp32 torch drafter (the same Q4_1 weights,
dequantized there) on nearly every greedy token, it refuses an adapter in one line, and greedy
speculative decoding with it keeps the target's own output.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DRAFTER, TEST_HOME

from omnidraft import models
from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.drafter import Drafter
from omnidraft.drafter.llamacpp_lm import LlamaCppDraftLM
from omnidraft.drafter.torch_lm import TorchDraftLM
from omnidraft.errors import OmnidraftError
from omnidraft.runtime import build_bridge, encode_prompt, load_pipeline
from omnidraft.target import TorchTarget

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
def test_it_refuses_an_adapter_and_fork_has_its_own_cache(gguf_lm):
    lm, tok = gguf_lm
    lm.apply_adapter(None)  # the base weights: fine
    with pytest.raises(ValueError, match="base weights only"):
        lm.apply_adapter({"x.lora_A.weight": torch.zeros(1, 1)})
    other = lm.fork()
    try:
        ids = list(tok.encode(TEXT))
        lm.reset()
        lm.logits_for(ids[:10])
        other.logits_for(ids[:30])
        assert lm.cached_ids == ids[:10] and other.cached_ids == ids[:30]
    finally:
        other.engine.close()


@pytest.mark.real
def test_greedy_with_the_gguf_drafter_is_the_targets_own_output(gguf_lm, real_models):
    lm, _ = gguf_lm
    d_model, d_tok = real_models(DRAFTER)
    t_model, t_tok = real_models("builtin:qwen2.5-coder-0.5b")
    target = TorchTarget(t_model, t_tok)
    bridge = build_bridge(d_model, d_tok, t_model, t_tok)
    stop = [d for d, t in enumerate(bridge.d2t_list) if t in target.eos_ids]
    decoder = SpeculativeDecoder(target, Drafter(lm, stop_ids=stop), bridge)
    ids = encode_prompt(t_tok, "def fibonacci(n):\n")
    plain = SpeculativeDecoder(target).generate(ids, DecodeConfig(max_new_tokens=32)).token_ids
    got = decoder.generate(ids, DecodeConfig(max_new_tokens=32, draft_len=4, draft_stop="fixed")).token_ids
    assert got == plain
    assert decoder.stats.proposed_tokens > 0 and decoder.stats.accepted_tokens > 0


@pytest.mark.real
def test_the_pipeline_loads_it_without_the_torch_drafter_and_refuses_an_adapter_path(tmp_path):
    with pytest.raises(OmnidraftError, match="base weights only"):
        load_pipeline("builtin:gemma3-270m", DRAFTER, home=TEST_HOME, quiet=True, adapter=str(tmp_path),
                      drafter_backend="llamacpp")
    pipe = load_pipeline("builtin:gemma3-270m", DRAFTER, home=TEST_HOME, quiet=True, drafter_backend="llamacpp")
    try:
        assert isinstance(pipe.decoder.drafter.lm, LlamaCppDraftLM) and pipe.drafter_model is None
        assert pipe.adapter_slot.current is None
    finally:
        pipe.decoder.drafter.lm.engine.close()
