"""The decoding loop: cross-vocabulary speculative decoding (OmniDraft Algorithm 1).

One step: draft k drafter tokens -> translate to m target tokens (n-gram merge, eq. (1)) -> one
target forward scores all m+1 positions -> verify -> reverse-translate what was emitted into the
drafter's context (learning n-grams on the way). With no drafter it is plain target decoding on
the same engine, which is what speedups are measured against.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from omnidraft.config import DecodeConfig
from omnidraft.drafter import Draft, Drafter
from omnidraft.errors import OmnidraftError
from omnidraft.ngram.trie import NgramTrie
from omnidraft.target import TargetBackend
from omnidraft.verify import greedy_verify, probs_from_logits, sample_verify
from omnidraft.vocab import DrafterContext, Translation, VocabBridge


@dataclass
class DecodeStats:
    """Per-request counters; acceptance rate as in the paper: accepted/proposed averaged over steps."""

    steps: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    ngram_hits_proposed: int = 0
    ngram_hits_accepted: int = 0
    new_tokens: int = 0
    ngram_cache_entries_at_start: int = 0
    ngram_cache_entries_at_end: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    bridge_s: float = 0.0
    verify_s: float = 0.0
    step_rates: list[float] = field(default_factory=list, repr=False)

    @property
    def acceptance_rate(self) -> float:
        return sum(self.step_rates) / len(self.step_rates) if self.step_rates else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "step_rates"}
        out.update(acceptance_rate=self.acceptance_rate, tokens_per_s=self.tokens_per_s,
                   tokens_per_target_forward=self.tokens_per_target_forward)
        return out


class DecodeObserver:
    """Hooks into the loop for what rides along decoding (recording for the trainer, publishing
    adapter weights, telling the trainer to yield). Every method is a no-op unless overridden."""

    def on_start(self, prompt_ids: Sequence[int]) -> None:
        """A request starts."""

    def before_step(self) -> None:
        """Between two steps: the only moment drafter weights may change."""

    def on_step(self, logits: torch.Tensor, emitted: Sequence[int]) -> None:
        """``logits[i]`` is the target's row that predicted ``emitted[i]``."""

    def on_finish(self) -> None:
        """The request ended (finished, cut at the budget, or interrupted)."""


@dataclass
class DecodeResult:
    text: str
    token_ids: list[int]
    stats: DecodeStats


class SpeculativeDecoder:
    """Target (+ optional drafter and bridge) with the loop as a generator and as a call."""

    def __init__(self, target: TargetBackend, drafter: Drafter | None = None,
                 bridge: VocabBridge | None = None, ngrams: NgramTrie | None = None) -> None:
        if (drafter is None) != (bridge is None):
            raise ValueError("a drafter needs a vocabulary bridge and vice versa")
        self.target, self.drafter, self.bridge = target, drafter, bridge
        self.ngrams = ngrams if ngrams is not None else (NgramTrie() if drafter is not None else None)
        self.stats = DecodeStats()
        self.observers: list[DecodeObserver] = []
        self._token_bytes: list[bytes | None] | None = None
        if bridge is not None:
            src = torch.nonzero(bridge.d2t >= 0).flatten()
            tgt = bridge.d2t[src]
            keep = tgt < target.vocab_size
            self._dm_src, self._dm_tgt = src[keep], tgt[keep]

    # ---- public API ----------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], config: DecodeConfig) -> DecodeResult:
        ids: list[int] = []
        for chunk in self.stream_ids(prompt_ids, config):
            ids.extend(chunk)
        text = self.target.tokenizer.decode(ids, skip_special_tokens=True)
        return DecodeResult(text, ids, self.stats)

    def stream(self, prompt_ids: Sequence[int], config: DecodeConfig) -> Iterator[str]:
        """Yield text as it is accepted (special tokens skipped; UTF-8 split across tokens joined)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        table = self.target_token_bytes()
        for chunk in self.stream_ids(prompt_ids, config):
            text = decoder.decode(b"".join(table[t] or b"" for t in chunk))
            if text:
                yield text
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail

    def stream_ids(self, prompt_ids: Sequence[int], config: DecodeConfig) -> Iterator[list[int]]:
        """Yield the target token ids emitted by each step; ``self.stats`` fills in as it runs."""
        config.validate()
        if not prompt_ids:
            raise OmnidraftError("the prompt is empty")
        self.stats = DecodeStats()
        if self.ngrams is not None:
            self.stats.ngram_cache_entries_at_start = len(self.ngrams)
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(config.seed)
        step = self._target_step if self.drafter is None else self._speculative_step
        ids = list(prompt_ids)
        observers = list(self.observers)
        for obs in observers:
            obs.on_start(ids)
        try:
            state = self._start_state(ids)
            while self.stats.new_tokens < config.max_new_tokens:
                for obs in observers:
                    obs.before_step()
                emitted, done, logits = step(ids, state, config, generator)
                for obs in observers:
                    obs.on_step(logits, emitted)
                ids.extend(emitted)
                self.stats.new_tokens += len(emitted)
                self.stats.wall_s = time.perf_counter() - start
                yield emitted
                if done:
                    break
        finally:
            self.stats.wall_s = time.perf_counter() - start
            if self.ngrams is not None:
                self.ngrams.flush()
                self.stats.ngram_cache_entries_at_end = len(self.ngrams)
            for obs in observers:
                obs.on_finish()

    # ---- one step ------------------------------------------------------------------------------
    def _start_state(self, prompt_ids: list[int]) -> DrafterContext | None:
        return DrafterContext(self.bridge, prompt_ids) if self.bridge is not None else None

    def _finish(self, emitted: list[int], remaining: int) -> tuple[list[int], bool]:
        """Cut at the first end-of-sequence token and at the token budget."""
        for j, tok in enumerate(emitted):
            if tok in self.target.eos_ids:
                return emitted[: j + 1][:remaining], True
        return emitted[:remaining], len(emitted) >= remaining

    def _target_step(self, ids, state, config: DecodeConfig, generator) -> tuple[list[int], bool, torch.Tensor]:
        t0 = time.perf_counter()
        logits = self.target.score(ids, 0)
        if config.temperature <= 0:
            nxt = int(logits[0].argmax())
        else:
            nxt = int(torch.multinomial(probs_from_logits(logits[0], config.temperature, config.top_p), 1, generator=generator))
        self.stats.verify_s += time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.target_forwards += 1
        return *self._finish([nxt], config.max_new_tokens - self.stats.new_tokens), logits

    def _speculative_step(self, ids, ctx: DrafterContext, config: DecodeConfig, generator) -> tuple[list[int], bool, torch.Tensor]:
        stats, remaining = self.stats, config.max_new_tokens - self.stats.new_tokens
        if remaining <= 1:  # nothing left to speculate on: one plain target step
            return self._target_step(ids, ctx, config, generator)
        sampling = config.verify != "greedy"
        text = config.text_translation
        ngrams = self.ngrams if config.use_ngram and config.verify != "tli" and not text else None
        t0 = time.perf_counter()
        confidence, gamma = self._stop_rule(config)
        draft = self.drafter.draft(ctx.ids, min(config.draft_len, remaining - 1), ngrams,
                                   config.temperature, config.top_p, generator, keep_q=sampling,
                                   confidence=confidence, free=text, gamma=gamma)
        t1 = time.perf_counter()
        tr = self.bridge.forward_text(ids, draft.tokens) if text else self.bridge.forward(draft.tokens, ngrams)
        proposed = tr.target_ids[: remaining - 1]
        t2 = time.perf_counter()
        logits = self.target.score(ids + proposed, len(proposed))
        if sampling:
            p = probs_from_logits(logits, config.temperature, config.top_p)
            cut_untranslatable = len(proposed) == len(tr.target_ids) and tr.drafted_used < len(draft.tokens)
            last = self._dm_target_probs(draft.q[tr.drafted_used]) if cut_untranslatable else None
            n, nxt = sample_verify(p, proposed, lambda i: self._draft_target_probs(draft, tr, i), generator, last)
        else:
            n, nxt = greedy_verify(logits, proposed)
        t3 = time.perf_counter()
        emitted, done = self._finish(proposed[:n] + [nxt], remaining)
        self._count(draft, tr, proposed, n)
        if not done:  # reverse translation (Algorithm 1, lines 17-19)
            self._reverse(ctx, draft, tr, emitted, n, text, self.ngrams if config.use_ngram else None)
        t4 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t3 - t2
        stats.bridge_s += (t2 - t1) + (t4 - t3)
        return emitted, done, logits

    def _stop_rule(self, config: DecodeConfig) -> tuple[float, float]:
        """(confidence threshold, γ) for this step's draft under ``config.draft_stop``."""
        has_head = self.drafter.head is not None
        if config.draft_stop == "head" and not has_head:
            raise OmnidraftError("--draft-stop head needs an adapter with an acceptance head (train one with "
                                 "`omnidraft adapt`), or use --draft-stop auto")
        if config.draft_stop == "head" or (config.draft_stop == "auto" and has_head):
            return 0.0, config.stop_gamma
        return (0.0 if config.draft_stop == "fixed" else config.draft_confidence), 0.0

    def _reverse(self, ctx: DrafterContext, draft: Draft, tr: Translation, emitted: list[int], accepted: int,
                 text: bool, ngrams: NgramTrie | None) -> None:
        """Accepted proposals go back as the drafter tokens that produced them; the rest re-tokenized."""
        kept = min(accepted, len(emitted))
        if text:
            accepted_bytes = b"".join(self.bridge.target_bytes(t) or b"" for t in emitted[:kept])
            leftover = ctx.extend_accepted_bytes(draft.tokens, accepted_bytes)
            for tok in emitted[kept:]:
                ctx.append_target(tok, ngrams, before=leftover)
                leftover = b""
            if leftover:
                ctx.append_bytes(leftover)
            return
        ctx.extend_accepted(draft.tokens, tr.spans[kept - 1][1] if kept else 0)
        for tok in emitted[kept:]:
            ctx.append_target(tok, ngrams)

    def _count(self, draft: Draft, tr: Translation, proposed: list[int], accepted: int) -> None:
        s = self.stats
        s.steps += 1
        s.target_forwards += 1
        s.drafted_tokens += len(draft.tokens)
        s.proposed_tokens += len(proposed)
        s.accepted_tokens += accepted
        if proposed:
            s.step_rates.append(accepted / len(proposed))
        for i in range(len(proposed)):
            if tr.ngram[i]:
                key = draft.tokens[tr.spans[i][0]: tr.spans[i][1]]
                s.ngram_hits_proposed += 1
                self.ngrams.note_proposed(key)
                if i < accepted:
                    s.ngram_hits_accepted += 1
                    self.ngrams.note_accepted(key)

    def _draft_target_probs(self, draft: Draft, tr: Translation, i: int) -> torch.Tensor:
        """q' over the target vocabulary at proposal i, eq. (2).

        Direct-mapped mass moves to the partner token (several drafter tokens may share one);
        for an n-gram the product of its sub-token probabilities goes to the n-gram token and is
        taken from its first sub-token's partner.
        """
        start, end = tr.spans[i]
        q_t = self._dm_target_probs(draft.q[start])
        if tr.ngram[i]:
            prod = float(torch.prod(torch.stack([draft.q[j, draft.tokens[j]] for j in range(start, end)])))
            first = int(self.bridge.d2t[draft.tokens[start]])
            if first >= 0:
                q_t[first] = max(float(q_t[first]) - prod, 0.0)
            q_t[tr.target_ids[i]] += prod
        return q_t

    def _dm_target_probs(self, row: torch.Tensor) -> torch.Tensor:
        """Drafter distribution moved onto the target vocabulary through the direct mapping."""
        q_t = torch.zeros(self.target.vocab_size, dtype=row.dtype)
        q_t.index_add_(0, self._dm_tgt, row[self._dm_src])
        return q_t

    def target_token_bytes(self) -> list[bytes | None]:
        """Bytes of each target token id (None for special tokens): what streaming decodes with.

        Built once: without a bridge the table is made from the whole target vocabulary.
        """
        if self.bridge is not None:
            return self.bridge.t.token_bytes
        if self._token_bytes is None:
            from omnidraft.vocab.token_bytes import build_token_table

            self._token_bytes = build_token_table(self.target.tokenizer, self.target.vocab_size).token_bytes
        return self._token_bytes
