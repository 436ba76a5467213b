"""Attention of several query rows without a copy of the KV cache per query head.

A grouped-query model (Qwen2.5-0.5B: 14 query heads share 2 KV heads) reads its cache through
transformers' SDPA in one of two ways. One query row packs the query heads of each KV head into
rows of one call, copying nothing. Several rows with a mask, which is every verify and every
prefill chunk after a cache, repeat the keys and values once per query head (``repeat_kv``): seven
copies of the whole cache per layer and forward, a cost that grows with the context until a verify
of a few proposals at a few thousand tokens of context costs more than one and a half plain steps
(docs/performance.md).

Here every row count packs as one row does: the ``g`` query heads of a KV head become ``g * rows``
query rows of one SDPA call against that head's keys, each with its own row's mask. Each row reads
what it reads alone up to SDPA's own rounding (~1e-7, the size of the stock path's differences
between a verify and one-row steps; tests/test_fastattention.py).

Like :mod:`omnidraft.fastlinear`, the packed path runs only inside ``fastlinear.enabled()`` (the
decode engine's forwards): a model shared with transformers' own ``generate`` runs stock there.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from omnidraft import fastlinear

NAME = "omnidraft_sdpa"


def _packable(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
              dropout: float, kwargs: dict) -> bool:
    """Whether the packed call computes what stock SDPA would: several rows, grouped heads, one
    mask shared by every head, and none of SDPA's extras (soft-capping, biases, attention sinks)."""
    extras = ("softcap", "position_bias", "s_aux", "sinks")
    return (fastlinear.active() and getattr(module, "num_key_value_groups", 1) > 1 and query.shape[2] > 1
            and mask is not None and mask.dim() == 4 and mask.shape[1] == 1 and not dropout
            and key.shape[1] * module.num_key_value_groups == query.shape[1]
            and all(kwargs.get(name) is None for name in extras))


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [b, heads, rows, d], key and value
    [b, kv_heads, n, d] → ([b, rows, heads, d], None)."""
    if not _packable(module, query, key, attention_mask, dropout, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, rows, dim = query.shape
    kv_heads, groups, positions = key.shape[1], module.num_key_value_groups, attention_mask.shape[-1]
    # query head kv * groups + g, row i → packed row g * rows + i of KV head kv; its mask is row i's
    packed = query.reshape(batch, kv_heads, groups * rows, dim)
    mask = attention_mask[:, :, None].expand(attention_mask.shape[0], 1, groups, rows, positions)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask.reshape(-1, 1, groups * rows, positions),
                                         scale=scaling)
    return out.reshape(batch, heads, rows, value.shape[-1]).transpose(1, 2).contiguous(), None


@functools.cache
def _register() -> None:
    """Register :func:`packed_sdpa` with transformers, once, when a model is first installed: the
    masking module it needs imports torch.distributed and sympy (over a second), which a process
    whose models all run on llama.cpp or the native drafter never needs."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, packed_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks stock SDPA gets


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Route the model's attention through :func:`packed_sdpa` where it runs SDPA (idempotent);
    a model on another implementation (eager, flash) keeps it."""
    _register()
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(NAME)
    return model
