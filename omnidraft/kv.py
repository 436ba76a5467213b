"""A causal LM with a KV cache that follows a token list: feed only what is new, crop on divergence.

Both the drafter and the target use it. The cache mirrors ``cached_ids``; a call with a new id list
crops the cache to the common prefix and feeds the rest in one forward (gpt-fast style: tensors in,
logits out). A plain ``DynamicCache()`` keeps every layer's full history, so Gemma-3's
sliding-window layers crop exactly too (the sliding window lives in the attention mask).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from omnidraft import fastlinear

PREFILL_CHUNK = 512  # tokens per forward when reading a long prompt: bounds the attention's memory


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix; fast path when one list extends the other."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def output_vocab_size(model: torch.nn.Module) -> int:
    """Rows of the LM head (may exceed the tokenizer's length); works for quantized heads too."""
    weight = model.get_output_embeddings().weight
    return int((weight() if callable(weight) else weight).shape[0])


def max_positions_of(model: torch.nn.Module) -> int:
    """How many positions the model was built for (its context limit); 2**31 when it does not say."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else 2**31


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: ``cache`` in recent transformers 5 releases
    (which warn on the old name and drop it in 5.40), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class CachedLM:
    """Model + KV cache + the token ids the cache holds."""

    def __init__(self, model: torch.nn.Module, transposed_head: bool = False) -> None:
        self.model = fastlinear.install(model, transposed_head)
        self.device = next(model.parameters()).device
        self.vocab_size = output_vocab_size(model)
        self._cache_kw = cache_keyword(model)
        self.reset()

    def session(self) -> CachedLM:
        """Another cache over the same model."""
        return CachedLM(self.model)

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.cached_ids: list[int] = []

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached tokens."""
        drop = len(self.cached_ids) - length
        if drop > 0:
            self.cache.crop(-drop)  # transformers 5: a negative count drops that many tokens
            del self.cached_ids[length:]

    @torch.inference_mode()
    def logits_for(self, ids: Sequence[int], keep: int = 1) -> torch.Tensor:
        """Logits (float32, [keep, vocab]) predicting the tokens after each of the last ``keep`` ids."""
        if keep < 1 or keep > len(ids):
            raise ValueError(f"keep must be in [1, {len(ids)}], got {keep}")
        self.crop(min(common_prefix_len(self.cached_ids, ids), len(ids) - keep))
        new = list(ids[len(self.cached_ids):])
        while len(new) - PREFILL_CHUNK >= keep:  # a long prompt: read it in chunks, keep no logits
            self._forward(new[:PREFILL_CHUNK], 1)
            new = new[PREFILL_CHUNK:]
        return self._forward(new, keep)[0, -keep:].float()

    def _forward(self, new: list[int], keep: int) -> torch.Tensor:
        input_ids = torch.tensor([new], dtype=torch.long, device=self.device)
        with fastlinear.enabled():
            out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=keep, **{self._cache_kw: self.cache})
        self.cache = out[self._cache_kw]
        self.cached_ids.extend(new)
        return out.logits

    def warm_up(self, max_rows: int) -> None:
        """One forward of each row count 1..``max_rows`` after a short prefix, so that fastlinear
        times its kernels now, while the machine is quiet, and not during the first requests: a
        server's first verifies share the cores with its clients' drafters, and a kernel chosen
        under that noise stays chosen for the process."""
        ids = [1 + i % (self.vocab_size - 1) for i in range(4 + max_rows)]
        for rows in range(1, max_rows + 1):
            self.reset()
            self.logits_for(ids[:4], 1)
            self.logits_for(ids[: 4 + rows], rows)
        self.reset()

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Feed one token after the cached ones (the drafting hot path: no prefix bookkeeping)."""
        with fastlinear.enabled():
            out = self.model(input_ids=torch.tensor([[token]], device=self.device), use_cache=True, logits_to_keep=1,
                             **{self._cache_kw: self.cache})
        self.cache = out[self._cache_kw]
        self.cached_ids.append(token)
        return out.logits[0, -1].float()
