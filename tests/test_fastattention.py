"""Packed grouped-query attention: each verify row reads what it reads alone, and the model runs
stock outside the decode engine."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from omnidraft import fastattention, fastlinear
from omnidraft.kv import CachedLM, cache_keyword

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=1024)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request):
    torch.manual_seed(0)
    if request.param == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SIZES)).eval()
    return LlamaForCausalLM(LlamaConfig(**SIZES)).eval()


@pytest.mark.parametrize("positions", [20, 700, 3000])
@pytest.mark.parametrize("rows", [2, 5, 9, 16, 64])
@pytest.mark.parametrize("heads, kv_heads, dim", [(14, 2, 64), (4, 1, 256), (9, 3, 64)])  # Qwen-0.5B, Gemma-3, SmolLM2
def test_each_packed_row_reads_what_the_row_reads_alone(positions, rows, heads, kv_heads, dim):
    torch.manual_seed(positions + rows)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    query, key, value = torch.randn(1, heads, rows, dim), torch.randn(1, kv_heads, positions, dim), torch.randn(1, kv_heads, positions, dim)
    mask = torch.ones(1, 1, rows, positions, dtype=torch.bool).tril(positions - rows)  # causal after a cached context
    with fastlinear.enabled():
        together, _ = fastattention.packed_sdpa(module, query, key, value, mask, scaling=dim ** -0.5)
        alone = [fastattention.packed_sdpa(module, query[:, :, i:i + 1], key, value, mask[:, :, i:i + 1], scaling=dim ** -0.5)[0]
                 for i in range(rows)]
    torch.testing.assert_close(together, torch.cat(alone, dim=1), rtol=0, atol=2e-6)  # SDPA's own rounding


@pytest.mark.parametrize("context", [20, 300])
@pytest.mark.parametrize("rows", [2, 9])
def test_a_verify_reads_what_its_rows_read_one_at_a_time(tiny, context, rows):
    ids = [1 + (i * 37) % 255 for i in range(context + rows)]
    together = CachedLM(tiny)
    together.logits_for(ids[:context], 1)
    verify = together.logits_for(ids, rows)  # rows of one forward after a cached context
    alone = CachedLM(tiny)
    alone.logits_for(ids[:context], 1)
    steps = torch.cat([alone.logits_for(ids[: context + i + 1], 1) for i in range(rows)])
    torch.testing.assert_close(verify, steps, rtol=0, atol=1e-5)


def test_the_engine_uses_the_packed_path_and_plain_forwards_run_stock(tiny, monkeypatch):
    CachedLM(tiny)
    assert tiny.config._attn_implementation == fastattention.NAME
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, *args, **kwargs):
        calls.append((query.shape[1], key.shape[1]))
        return real(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    kw = cache_keyword(tiny)
    past = tiny(torch.tensor([[3, 4, 5]]), use_cache=True)[kw]
    tiny(torch.tensor([[6, 7, 8, 9]]), use_cache=True, **{kw: past})  # outside the engine: stock
    assert calls and all(q == SIZES["num_attention_heads"] for q, _ in calls)  # repeat_kv: one row per head
    calls.clear()
    with fastlinear.enabled():
        past = tiny(torch.tensor([[3, 4, 5]]), use_cache=True)[kw]
        calls.clear()
        tiny(torch.tensor([[6, 7, 8, 9]]), use_cache=True, **{kw: past})
    assert calls and all(q == k == SIZES["num_key_value_heads"] for q, k in calls)  # packed per KV head


def test_the_packed_path_agrees_with_stock_sdpa(tiny):
    ids, kw = torch.tensor([[1 + (i * 11) % 255 for i in range(40)]]), cache_keyword(tiny)
    with torch.inference_mode():
        past = tiny(ids[:, :30], use_cache=True)[kw]
        stock = tiny(ids[:, 30:], use_cache=True, **{kw: past}).logits
        past = tiny(ids[:, :30], use_cache=True)[kw]
        with fastlinear.enabled():
            packed = tiny(ids[:, 30:], use_cache=True, **{kw: past}).logits
    torch.testing.assert_close(packed, stock, rtol=1e-5, atol=1e-5)
