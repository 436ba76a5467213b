"""Tiny random models with tiny, *different* byte-level BPE vocabularies, for fast unit tests."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "speculative decoding drafts tokens and the target verifies them",
    "def add(a, b):\n    return a + b\n",
    "numbers like 12345 and 67890 appear in the text",
] * 50


def tiny_tokenizer(vocab_size: int, corpus: list[str] = CORPUS) -> PreTrainedTokenizerFast:
    """A GPT-2 style byte-level BPE trained on a small corpus; vocab_size sets how many merges."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_model(vocab_size: int, seed: int, sharpness: float = 8.0, positions: int = 256) -> LlamaForCausalLM:
    """A 1-layer random Llama whose output logits are scaled up so distributions are peaked."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=positions,
                      eos_token_id=0, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


# A drafter vocabulary trained on a differently weighted corpus: its merges differ from the target's.
DRAFTER_CORPUS = CORPUS[1::4] * 3 + CORPUS[3::4]


def tiny_pair():
    """(drafter model, target, bridge) of the standard tiny pair: different vocabularies, shared bytes."""
    from omnidraft.runtime import build_bridge
    from omnidraft.target import TorchTarget

    d_tok, t_tok = tiny_tokenizer(330, DRAFTER_CORPUS), tiny_tokenizer(420)
    d_model, t_model = tiny_model(len(d_tok), seed=1), tiny_model(len(t_tok), seed=2)
    target = TorchTarget(t_model, t_tok)
    return d_model, target, build_bridge(d_model, d_tok, t_model, t_tok)


def holding_costs(policy):
    """``policy`` (a CostPolicy) with its verify, drafter and read costs held where the test set them:
    it still learns acceptance, but no timing of this host's steps moves a cost, so a test of what the
    policy does at given costs does not turn on how fast or loaded the host is."""
    for cost in (policy.verify_costs, policy.draft_cost, policy.read_cost):
        cost.observe = lambda *args: None
    for cost in (policy.draft_cost, policy.read_cost):
        cost.relax = lambda *args: None
    return policy
