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

from omnidraft import fastattention, fastlinear
from omnidraft.verify.tree import Branch, check_branches, rows_of

PREFILL_CHUNK = 512  # tokens per forward when reading a long prompt: bounds the attention's memory
TREE_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # plain causal attention: a 4D mask is all a tree read needs


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


def tree_mask(past: int, new: int, proposed: int, branches: Sequence[Branch], dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask [1, 1, rows, past + rows] of a tree read: ``new`` tokens after
    ``past`` cached ones, the last ``proposed`` of them the chain's proposals, then each branch's
    tokens. Chain rows are causal; a branch's row j sees the cache, the new tokens up to the chain
    position it hangs from, and its own first j + 1 tokens (never the chain it replaces)."""
    rows = new + rows_of(branches)
    visible = torch.zeros(rows, past + rows, dtype=torch.bool)
    visible[:, :past] = True
    visible[:new, past: past + new] = torch.ones(new, new, dtype=torch.bool).tril()
    row = new
    for b in branches:
        n = len(b.tokens)
        visible[row: row + n, past: past + new - proposed + b.depth] = True
        visible[row: row + n, past + row: past + row + n] = torch.ones(n, n, dtype=torch.bool).tril()
        row += n
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def tree_positions(past: int, new: int, proposed: int, branches: Sequence[Branch]) -> list[int]:
    """Each row's position: the new tokens in order, a branch's tokens where the chain's would be."""
    positions = list(range(past, past + new))
    base = past + new - proposed  # the first proposal's position
    for b in branches:
        positions += range(base + b.depth, base + b.depth + len(b.tokens))
    return positions


class CachedLM:
    """Model + KV cache + the token ids the cache holds."""

    def __init__(self, model: torch.nn.Module, transposed_head: bool = False) -> None:
        self.model = fastattention.install(fastlinear.install(model, transposed_head))
        self.device = next(model.parameters()).device
        self.vocab_size = output_vocab_size(model)
        self._cache_kw = cache_keyword(model)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        # token trees need attention that a mask alone decides (no sliding windows, no per-layer kinds)
        self.trees = config.model_type in TREE_MODEL_TYPES and not getattr(config, "use_sliding_window", False)
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
    def logits_for(self, ids: Sequence[int], keep: int = 1, branches: Sequence[Branch] = ()) -> torch.Tensor:
        """Logits (float32, [keep, vocab]) predicting the tokens after each of the last ``keep`` ids.

        ``branches`` (where ``trees``): the last ``keep - 1`` ids are a chain of proposals, and each
        branch another way it could go (``verify.tree``); their rows follow the chain's, one per
        branch token, in the same forward. The cache keeps the chain only: an accepted branch is
        read again with the next step's tokens (one more row of a forward that reads a few)."""
        if keep < 1 or keep > len(ids):
            raise ValueError(f"keep must be in [1, {len(ids)}], got {keep}")
        if branches and not self.trees:
            raise ValueError("this model's attention cannot read token trees")
        check_branches(branches, keep - 1)
        self.crop(min(common_prefix_len(self.cached_ids, ids), len(ids) - keep))
        new = list(ids[len(self.cached_ids):])
        while len(new) - PREFILL_CHUNK >= keep:  # a long prompt: read it in chunks, keep no logits
            self._forward(new[:PREFILL_CHUNK], 1)
            new = new[PREFILL_CHUNK:]
        if not branches:
            return self._forward(new, keep)[0, -keep:].float()
        return self._forward_tree(new, keep - 1, branches).float()

    def _forward(self, new: list[int], keep: int) -> torch.Tensor:
        input_ids = torch.tensor([new], dtype=torch.long, device=self.device)
        with fastlinear.enabled():
            out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=keep, **{self._cache_kw: self.cache})
        self.cache = out[self._cache_kw]
        self.cached_ids.extend(new)
        return out.logits

    def _forward_tree(self, new: list[int], proposed: int, branches: Sequence[Branch]) -> torch.Tensor:
        """One forward of ``new`` (its last ``proposed`` tokens the chain) and the branches; the
        chain's last ``proposed + 1`` rows and every branch row. The branch entries leave the cache."""
        past, extra = len(self.cached_ids), rows_of(branches)
        tokens = new + [t for b in branches for t in b.tokens]
        dtype = next(self.model.parameters()).dtype
        with fastlinear.enabled():
            out = self.model(input_ids=torch.tensor([tokens], dtype=torch.long, device=self.device),
                             position_ids=torch.tensor([tree_positions(past, len(new), proposed, branches)], device=self.device),
                             attention_mask=tree_mask(past, len(new), proposed, branches, dtype).to(self.device),
                             use_cache=True, logits_to_keep=proposed + 1 + extra, **{self._cache_kw: self.cache})
        self.cache = out[self._cache_kw]
        self.cache.crop(-extra)
        self.cached_ids.extend(new)
        return out.logits[0]

    def warm_up(self, max_rows: int, progress: bool = False) -> int:
        """Time fastlinear's kernels now (``fastlinear.prepare``) for every verify of 1..``max_rows``
        rows and for short prompt reads, where no choice is kept yet. Timed during requests instead,
        a first run's benchmark measures the timing, and a server's first verifies would share the
        cores with its clients' drafters: a kernel chosen under that noise stays chosen."""
        return fastlinear.prepare(self.model, [*range(1, max_rows + 1), *fastlinear.PROMPT_CLASSES], progress)

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Feed one token after the cached ones (the drafting hot path: no prefix bookkeeping)."""
        with fastlinear.enabled():
            out = self.model(input_ids=torch.tensor([[token]], device=self.device), use_cache=True, logits_to_keep=1,
                             **{self._cache_kw: self.cache})
        self.cache = out[self._cache_kw]
        self.cached_ids.append(token)
        return out.logits[0, -1].float()
