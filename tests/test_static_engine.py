"""The static-shape engine (the GPU target's): the same logits as transformers, the same bits for a
token whether it was read alone or inside a verify, and greedy speculative output equal to the
engine's own. It runs on the CPU here (no graphs); the GPU run is measured in docs/remote.md."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.errors import OmnidraftError
from omnidraft.runtime import make_drafter, target_device
from omnidraft.target import TorchTarget
from omnidraft.target import static
from tests.tiny import tiny_pair

SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def _models():
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(**SIZES, tie_word_embeddings=False)).eval()  # q/k/v biases
    llama = LlamaForCausalLM(LlamaConfig(**SIZES, rope_theta=100000.0)).eval()
    return {"qwen2": qwen, "llama": llama}


MODELS = _models()
IDS = torch.randint(1, 300, (70,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_static_engine_gives_the_logits_transformers_gives(arch):
    model = MODELS[arch]
    lm = static.StaticLM(static.extract(model, "cpu", torch.float32), max_context=256)
    with torch.no_grad():
        reference = model(torch.tensor([IDS])).logits[0]
    assert torch.allclose(lm.logits_for(IDS[:40], 1)[0], reference[39], atol=1e-4)  # a prompt: the prefill class
    for t in range(40, 48):  # plain steps
        assert torch.allclose(lm.logits_for(IDS[: t + 1], 1)[0], reference[t], atol=1e-4)
    verify = lm.logits_for(IDS[:60], 12)  # one emitted token and 11 proposals: the decode class
    assert torch.allclose(verify, reference[48:60], atol=1e-4)
    assert lm.logits_for(IDS[:45], 1).shape == (1, lm.vocab_size)  # a rejection: crop, read again


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_a_token_reads_the_same_bits_alone_or_among_proposals(arch):
    lm = static.StaticLM(static.extract(MODELS[arch], "cpu", torch.float32), max_context=256)
    verify = lm.logits_for(IDS[:50], 10)  # prompt of 41 tokens, then 9 proposals after it
    lm.reset()
    alone = [lm.logits_for(IDS[:41], 1)] + [lm.logits_for(IDS[: t + 1], 1) for t in range(41, 50)]
    assert torch.equal(torch.cat(alone), verify)
    long = lm.logits_for(IDS[:70], 20)  # more than one decode forward: rows still independent of the chunking
    lm.crop(50)
    steps = torch.cat([lm.logits_for(IDS[: t + 1], 1) for t in range(50, 70)])
    assert torch.equal(steps, long)


def test_static_engine_refuses_what_it_cannot_run_and_past_its_context():
    model = MODELS["llama"]
    model.config.model_type, saved = "gemma3_text", model.config.model_type
    try:
        assert "architecture" in static.unsupported_reason(model)
        with pytest.raises(ValueError, match="cannot run"):
            static.extract(model, "cpu", torch.float32)
    finally:
        model.config.model_type = saved
    lm = static.StaticLM(static.extract(model, "cpu", torch.float32), max_context=32)
    assert TorchTarget(model, None, lm).max_context == 32
    with pytest.raises(ValueError, match="context of 32"):
        lm.logits_for(IDS[:33], 1)


def test_greedy_speculative_output_equals_the_static_engine_alone_across_requests():
    d_model, eager, bridge = tiny_pair()
    lm = static.StaticLM(static.extract(eager.model, "cpu", torch.float32), max_context=200)
    target = TorchTarget(eager.model, eager.tokenizer, lm)
    decoder = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)
    alone = SpeculativeDecoder(target.session())
    config = DecodeConfig(max_new_tokens=20, draft_stop="fixed", draft_len=5, lookup=False)
    prompt = eager.tokenizer.encode("the cat sat on")
    for turn in range(2):  # the second request extends the first, as a chat's next turn does
        expected = alone.generate(prompt, config).token_ids
        got = decoder.generate(prompt, config)
        assert got.token_ids == expected
        prompt = prompt + expected + eager.tokenizer.encode(" and the dog")
    assert decoder.stats.drafted_tokens > 0  # verifies of several rows ran


def test_device_cuda_is_refused_clearly_where_torch_sees_no_gpu():
    if torch.cuda.is_available():
        assert target_device("builtin:qwen2.5-coder-0.5b", "cuda") == "cuda"
    else:
        with pytest.raises(OmnidraftError, match="no CUDA device"):
            target_device("builtin:qwen2.5-coder-0.5b", "cuda")
        assert target_device("builtin:qwen2.5-coder-0.5b", "auto") == "cpu"
    assert target_device("grpc://127.0.0.1:1", "cuda") == "cpu"  # the server places a remote target
