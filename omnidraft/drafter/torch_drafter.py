"""The drafter: proposes up to k drafter tokens from its own KV cache (Algorithm 1, lines 5-7).

Proposals are restricted to what the bridge can translate: direct-mapped tokens, plus sub-tokens
that start or extend an n-gram in the cache (so 'f', 'la', 'ke' may become the target's 'flake').
For the sampling verifiers each step keeps its draft distribution q (after the restriction,
temperature and top-p): that is the distribution the token was actually drawn from.

How many tokens to draft: up to k, stopping early either after a token whose own probability is
below a fixed confidence, or, when the adapter in use carries a learned acceptance head, once the
head's P(some drafted token is rejected) exceeds γ (OmniDraft §3.3, eq. (5)-(7)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnidraft.kv import CachedLM
from omnidraft.ngram.trie import NgramTrie, TrieNode
from omnidraft.train.accept_head import AcceptHead, should_stop
from omnidraft.verify.core import probs_from_logits
from omnidraft.vocab.bridge import VocabBridge


@dataclass
class Draft:
    tokens: list[int]
    q: torch.Tensor | None  # [len(tokens), drafter vocab] when sampling, else None


class Drafter:
    """Autoregressive drafting over a cached causal LM with a translatability mask."""

    def __init__(self, model: torch.nn.Module, bridge: VocabBridge, stop_ids: Sequence[int] = ()) -> None:
        self.lm = CachedLM(model, transposed_head=True)  # drafting decodes one row at a time
        self.bridge = bridge
        self.stop_ids = {int(t) for t in stop_ids}  # drafter ids after which drafting is pointless
        vocab = self.lm.vocab_size
        bias = torch.full((vocab,), float("-inf"))
        bias[: len(bridge.dm_bias)] = bridge.dm_bias[:vocab]
        self.dm_bias = bias
        # Text translation can carry any drafter token with bytes, and specials with a partner.
        text_ok = [data is not None or bridge.d2t_list[i] >= 0 for i, data in enumerate(bridge.d.token_bytes[:vocab])]
        self.text_bias = torch.full((vocab,), float("-inf"))
        self.text_bias[: len(text_ok)] = torch.where(torch.tensor(text_ok), 0.0, float("-inf"))
        # Memo of _root_extras, keyed by the cache object *and* its version: one drafter serves
        # several caches (bench modes, the cache ablation's configurations), whose versions or
        # lengths can coincide while their keys differ. Holding the cache keeps its id unique.
        self._root_cache: NgramTrie | None = None
        self._root_version = -1
        self._root_extra = torch.empty(0, dtype=torch.long)
        self.head: AcceptHead | None = None  # set by the adapter slot with the adapter's head
        self._hidden = torch.empty(0)  # the LM head's input at the last position (the head's e_i)
        model.get_output_embeddings().register_forward_pre_hook(self._keep_hidden)

    def _keep_hidden(self, _module, args) -> None:
        self._hidden = args[0][0, -1]

    def reset(self) -> None:
        self.lm.reset()

    def _root_extras(self, ngrams: NgramTrie) -> torch.Tensor:
        """Non-direct-mapped first sub-tokens of cached n-grams (recomputed when the cache grows)."""
        version = getattr(ngrams, "version", len(ngrams))  # a capped store evicts without changing len
        if self._root_cache is not ngrams or self._root_version != version:
            ids = [t for t in ngrams.root.children if t < len(self.dm_bias) and not torch.isfinite(self.dm_bias[t])]
            self._root_extra = torch.tensor(ids, dtype=torch.long)
            self._root_cache, self._root_version = ngrams, version
        return self._root_extra

    def _bias(self, ngrams: NgramTrie | None, active: list[TrieNode]) -> torch.Tensor:
        if ngrams is None or not len(ngrams):
            return self.dm_bias
        extra = [t for node in active for t in node.children]
        root = self._root_extras(ngrams)
        if not extra and not len(root):
            return self.dm_bias
        bias = self.dm_bias.clone()
        bias[root] = 0.0
        if extra:
            bias[torch.tensor(extra, dtype=torch.long)] = 0.0
        return bias

    def draft(
        self,
        context: Sequence[int],
        k: int,
        ngrams: NgramTrie | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        keep_q: bool = False,
        confidence: float = 0.0,
        free: bool = False,
        gamma: float = 0.0,
    ) -> Draft:
        """Draft up to ``k`` tokens after ``context`` (drafter ids); stop early after a token whose
        draft probability is below ``confidence``, or (``gamma`` > 0 and a head is set) once the
        acceptance head's P(any drafted token rejected) exceeds ``gamma``, eq. (7)."""
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        active: list[TrieNode] = []
        accept_probs: list[float] = []
        use_head = gamma > 0 and self.head is not None
        logits = self.lm.logits_for(context)[0]
        for step in range(k):
            masked = logits + (self.text_bias if free else self._bias(ngrams, active))
            doubtful = False
            if use_head:  # eq. (5)-(7); the token that crosses γ is still proposed (its draft is paid for)
                accept_probs.append(self.head.accept_prob(self._hidden, logits))
                doubtful = should_stop(accept_probs, gamma)
            if temperature <= 0 and not keep_q:
                tok = int(masked.argmax())
                if confidence > 0:
                    doubtful = doubtful or float(torch.softmax(masked, -1)[tok]) < confidence
            else:
                q = probs_from_logits(masked, temperature, top_p)
                tok = int(masked.argmax()) if temperature <= 0 else int(torch.multinomial(q, 1, generator=generator))
                qs.append(q)
                doubtful = doubtful or float(q[tok]) < confidence
            tokens.append(tok)
            if ngrams is not None and len(ngrams):
                active = [c for node in active + [ngrams.root] if (c := node.children.get(tok)) is not None]
            if tok in self.stop_ids or step == k - 1 or doubtful:
                break
            logits = self.lm.step(tok)
        return Draft(tokens, torch.stack(qs) if qs else None)
