"""The decoding loop: cross-vocabulary speculative decoding (OmniDraft Algorithm 1).

One step: the drafter drafts under a policy -> the translator turns drafter tokens into target
tokens -> one target forward scores all m+1 positions -> a verification rule keeps n of them and
picks the next token -> the translator appends what was emitted to the drafter's context. Each of
those is a strategy object chosen once per request (:meth:`SpeculativeDecoder.plan`), so the step
itself has no flags. With no drafter it is plain target decoding on the same engine, which is
what speedups are measured against.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields

import torch

from omnidraft.config import DecodeConfig
from omnidraft.console import Utf8Stream, warn
from omnidraft.drafter import Draft, Drafter, DraftPolicy, Sampler
from omnidraft.drafter.budget import DraftBudget
from omnidraft.drafter.history import PROMPT_TAIL, LookupHistory
from omnidraft.drafter.lookup import LookupIndex
from omnidraft.drafter.policy import stop_rule
from omnidraft.errors import OmnidraftError
from omnidraft.ngram.trie import NgramCache, NgramTrie
from omnidraft.target import Target
from omnidraft.target.base import LocalVerifier, RowRequest
from omnidraft.verify import rule_info
from omnidraft.vocab.bridge import Translation, VocabBridge
from omnidraft.vocab.reverse import DrafterContext
from omnidraft.vocab.slrs import StringTranslator, check_lookahead
from omnidraft.vocab.translate import (
    RedistributingTranslator,
    TextTranslator,
    TokenTranslator,
    Translator,
)

LOOKUP_RULES = ("greedy", "text-sample")  # rules that verify a deterministic draft of target ids
LOOKUP_MAX = 16  # most tokens a lookup draft copies (it costs nothing to draft; the policy cuts it)


@dataclass
class DecodeStats:
    """Per-request counters; acceptance rate as in the paper: accepted/proposed averaged over steps.

    Stats add up (``a + b``): a chat session's totals are the sum of its turns' stats.
    """

    steps: int = 0
    target_forwards: int = 0
    plain_steps: int = 0  # steps where the draft policy chose not to draft (it would not have paid)
    lookup_steps: int = 0  # steps that verified a prompt-lookup draft
    history_steps: int = 0  # of those, drafts from earlier outputs (the lookup history), not the context
    lookup_proposed: int = 0
    lookup_accepted: int = 0
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
    measure_s: float = 0.0  # the cost policy's one-time measurement of this machine, not in wall_s
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

    @property
    def other_s(self) -> float:
        """Wall time outside drafting, verifying and translating (Python, bookkeeping)."""
        return max(self.wall_s - self.draft_s - self.verify_s - self.bridge_s, 0.0)

    def __add__(self, other: DecodeStats) -> DecodeStats:
        total = DecodeStats()
        for f in fields(self):
            setattr(total, f.name, getattr(self, f.name) + getattr(other, f.name))
        total.ngram_cache_entries_at_start = self.ngram_cache_entries_at_start if self.steps else other.ngram_cache_entries_at_start
        total.ngram_cache_entries_at_end = other.ngram_cache_entries_at_end
        return total

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


@dataclass
class Proposal:
    """What one step proposes to the verification rule."""

    draft: Draft
    translation: Translation
    proposed: list[int]
    translator: Translator


@dataclass
class Plan:
    """The strategies of one request, chosen once from its config."""

    translator: Translator
    policy: DraftPolicy
    budget: DraftBudget | None  # the cost-aware policy's numbers (None: a fixed stop rule)


class SpeculativeDecoder:
    """Target (+ optional drafter and bridge) with the loop as a generator and as a call."""

    def __init__(self, target: Target, drafter: Drafter | None = None,
                 bridge: VocabBridge | None = None, ngrams: NgramCache | None = None, lookup: bool | None = None,
                 history: LookupHistory | None = None) -> None:
        """``lookup``: draft by prompt lookup where the config allows it (default: when there is a
        drafter, so the target alone stays the baseline; True: lookup alone without a drafter).
        ``history``: earlier outputs to look up when the context has no match; each request with
        lookup on adds its output to it."""
        if (drafter is None) != (bridge is None):
            raise ValueError("a drafter needs a vocabulary bridge and vice versa")
        self.target, self.drafter, self.bridge = target, drafter, bridge
        # Score and verify where the target runs: a remote target is its own verifier.
        self.verifier = target if hasattr(target, "verify") else LocalVerifier(target)
        self.ngrams = ngrams if ngrams is not None else (NgramTrie() if drafter is not None else None)
        self.stats = DecodeStats()
        self.observers: list[DecodeObserver] = []
        self._token_bytes: list[bytes | None] | None = None
        self._translators: dict[tuple, Translator] = {}
        self.budget = DraftBudget()  # measured costs and acceptance, kept across requests
        self.use_lookup = drafter is not None if lookup is None else lookup
        self.lookup = LookupIndex()
        self.history = history

    # ---- public API ----------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], config: DecodeConfig) -> DecodeResult:
        ids: list[int] = []
        for chunk in self.stream_ids(prompt_ids, config):
            ids.extend(chunk)
        text = self.target.tokenizer.decode(ids, skip_special_tokens=True)
        return DecodeResult(text, ids, self.stats)

    def stream(self, prompt_ids: Sequence[int], config: DecodeConfig) -> Iterator[str]:
        """Yield text as it is accepted (special tokens skipped; UTF-8 split across tokens joined)."""
        utf8, table = Utf8Stream(), self.target_token_bytes()
        for chunk in self.stream_ids(prompt_ids, config):
            text = utf8.feed(table[t] for t in chunk)
            if text:
                yield text
        tail = utf8.finish()
        if tail:
            yield tail

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        """A prompt that cannot fit the target's context is refused before any model work."""
        limit = self.target.max_context
        if prompt_len + max_new_tokens > limit:
            raise OmnidraftError(f"the prompt ({prompt_len} tokens) plus up to {max_new_tokens} new tokens exceed the "
                                 f"target's context of {limit} tokens; shorten the prompt or lower --max-new-tokens")

    def _measure_costs(self, ids: list[int]) -> float:
        """Time the verify per draft length and the drafter per token on this prompt, once per home
        (the budget is saved with the home). Returns the seconds it took, which the request's tok/s
        leaves out; the engines are reset after it, so the request still reads its whole prompt."""
        t0 = time.perf_counter()
        drafter_ids = DrafterContext(self.bridge, ids).ids if self.drafter is not None else []
        self.budget.measure(self.verifier, self.drafter, ids, drafter_ids)
        self.verifier.reset()
        if self.drafter is not None:
            self.drafter.reset()
        return time.perf_counter() - t0

    def stream_ids(self, prompt_ids: Sequence[int], config: DecodeConfig) -> Iterator[list[int]]:
        """Yield the target token ids emitted by each step; ``self.stats`` fills in as it runs."""
        config.validate()
        if not prompt_ids:
            raise OmnidraftError("the prompt is empty")
        self.check_length(len(prompt_ids), config.max_new_tokens)
        generator = torch.Generator().manual_seed(config.seed)  # the drafter's sampling (verification: step_generator)
        plan = self.plan(config, generator) if self.drafter is not None else None
        rows = next((r for r in (getattr(o, "row_request", None) for o in self.observers) if r is not None), None)
        self.stats = DecodeStats()
        if self.ngrams is not None:
            self.stats.ngram_cache_entries_at_start = len(self.ngrams)
        ids = list(prompt_ids)
        lookup = self._lookup_on(config)
        cost_aware = config.draft_stop == "auto" and (plan is not None or lookup)
        if cost_aware and not self.budget.measured:
            self.stats.measure_s = self._measure_costs(ids)
        start = time.perf_counter()
        ctx = DrafterContext(self.bridge, ids) if plan is not None else None
        stale = False
        if lookup:  # indexed once per request (the prompt), then extended by each step's tokens
            self.lookup.sync(ids)
        observers = list(self.observers)
        for obs in observers:
            obs.on_start(ids)
        try:
            while self.stats.new_tokens < config.max_new_tokens:
                for obs in observers:
                    obs.before_step()
                copied, source = self._lookup_draft(ids, config, cost_aware) if lookup else ([], "")
                budget = self._draft_budget(plan, config) if not copied else 0
                if copied:  # a prompt-lookup draft: target ids, nothing to translate
                    emitted, done, logits = self._lookup_step(ids, copied, source, config, cost_aware, rows)
                    if plan is not None and not stale and not done:  # the drafter's context follows the text
                        plan.translator.reverse(ctx, Draft([], None), Translation(), emitted, 0)
                elif budget == 0:  # no drafter, one token left, or drafting would not pay: a plain step
                    emitted, done, logits = self._target_step(ids, config, cost_aware, rows)
                    stale = plan is not None  # the drafter's context is caught up when drafting resumes
                else:
                    if stale:
                        ctx, stale = self._rebuild_context(ids), False
                    emitted, done, logits = self._speculative_step(ids, ctx, plan, config, budget, rows)
                for obs in observers:
                    obs.on_step(logits, emitted)
                ids.extend(emitted)
                if lookup:
                    self.lookup.extend(emitted)
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
            if self.history is not None and lookup and self.stats.new_tokens:
                self._remember(len(prompt_ids), ids)
            for obs in observers:
                obs.on_finish()

    # ---- prompt lookup -------------------------------------------------------------------------
    def _lookup_on(self, config: DecodeConfig) -> bool:
        """Lookup drafts are deterministic target ids: the greedy and text-sample rules verify them."""
        rules = self.verifier.rules
        return (self.use_lookup and config.lookup and config.verify in LOOKUP_RULES
                and (rules is None or config.verify in rules))

    def _lookup_draft(self, ids: list[int], config: DecodeConfig, cost_aware: bool) -> tuple[list[int], str]:
        """The continuation of the longest earlier match of the text's end, as long as it pays, and
        its source ("context-4", "history-3", …): acceptance is counted per source and match length,
        since a 4-token match in the context is far likelier to continue as before than a 2-token one."""
        remaining = config.max_new_tokens - self.stats.new_tokens
        if remaining <= 1:
            return [], ""
        k_max = min(LOOKUP_MAX, remaining - 1)
        copied, matched = self.lookup.propose(k_max)
        from_history = not copied and self.history is not None
        if from_history:
            copied, matched = self.history.propose_match(ids, k_max)
        if not copied:
            return [], ""
        source = f"{'history' if from_history else 'context'}-{matched}"
        if cost_aware:  # verification decides what is kept
            copied = copied[: self.budget.plan_lookup(len(copied), source)]
        if copied and from_history:
            self.stats.history_steps += 1  # a non-empty draft is always verified by _lookup_step
        return copied, source

    def _remember(self, prompt_len: int, ids: list[int]) -> None:
        """Add the output (after the prompt's last ids, so its first tokens can be found from
        them) to the lookup history and write it; a failure is one line, never a failed request."""
        try:
            self.history.record(ids[max(prompt_len - PROMPT_TAIL, 0):])
            self.history.save()
        except Exception as exc:  # noqa: BLE001 - the history only accelerates; the output is already out
            warn(f"the lookup history was not updated: {exc}")

    def _lookup_step(self, ids: list[int], copied: list[int], source: str, config: DecodeConfig, cost_aware: bool,
                     rows: RowRequest | None):
        remaining = config.max_new_tokens - self.stats.new_tokens
        t0 = time.perf_counter()
        proposal = Proposal(Draft([], None), Translation(list(copied)), list(copied), None)
        verdict = self.verifier.verify(ids, proposal, config, rows)
        seconds = time.perf_counter() - t0
        n = verdict.accepted
        emitted, done = self._finish(copied[:n] + [verdict.next_token], remaining)
        s = self.stats
        if cost_aware:
            self.budget.observe_lookup(source, len(copied), n, seconds if s.steps > 0 else None)
        s.verify_s += seconds
        s.steps += 1
        s.target_forwards += 1
        s.proposed_tokens += len(copied)
        s.accepted_tokens += n
        s.step_rates.append(n / len(copied))
        s.lookup_steps += 1
        s.lookup_proposed += len(copied)
        s.lookup_accepted += n
        return emitted, done, verdict.rows

    # ---- strategies ----------------------------------------------------------------------------
    def plan(self, config: DecodeConfig, generator: torch.Generator) -> Plan:
        """The rule, translator and draft policy ``config`` asks for."""
        info = rule_info(config.verify)
        if self.verifier.rules is not None and config.verify not in self.verifier.rules:
            raise OmnidraftError(f"--verify {config.verify} needs the drafter's distribution next to the target; this "
                                 f"target verifies {' or '.join(self.verifier.rules)}")
        translation = info.translations[0] if config.translate == "auto" else config.translate
        translator = self.translator(translation, config.use_ngram and info.uses_ngrams, config.use_ngram,
                                     config.slrs_lookahead)
        sampler = translator.sampler(Sampler(config.temperature if info.keeps_q else 0.0, config.top_p, info.keeps_q, generator))
        budget = self.budget if config.draft_stop == "auto" else None
        stop = translator.stop_rule(stop_rule(config.draft_stop, self.drafter.head, config.draft_confidence,
                                              config.stop_gamma, budget, config.draft_len))
        policy = DraftPolicy(sampler, translator.constraint(self.drafter.lm.vocab_size), stop)
        return Plan(translator, policy, budget)

    def translator(self, translation: str, propose_ngrams: bool, learn_ngrams: bool, lookahead: int = 1) -> Translator:
        """One translator per kind, kept for the decoder's life (they hold masks and memos)."""
        key = (translation, propose_ngrams and translation == "tokens", learn_ngrams, lookahead if translation == "strings" else 0)
        if key not in self._translators:
            learn = self.ngrams if learn_ngrams else None
            if translation == "text":
                self._translators[key] = TextTranslator(self.bridge, learn)
            elif translation == "rdk":
                self._translators[key] = RedistributingTranslator(self.bridge, self.target.vocab_size, learn)
            elif translation == "strings":
                check_lookahead(self.bridge, lookahead)  # refused where ψ would blow up (SLRS §3.4)
                self._translators[key] = StringTranslator(self.bridge, self.target.vocab_size, learn, lookahead, self.drafter)
            else:
                propose = self.ngrams if key[1] else None
                self._translators[key] = TokenTranslator(self.bridge, self.target.vocab_size, propose, learn)
        return self._translators[key]

    # ---- one step ------------------------------------------------------------------------------
    def _finish(self, emitted: list[int], remaining: int) -> tuple[list[int], bool]:
        """Cut at the first end-of-sequence token and at the token budget."""
        for j, tok in enumerate(emitted):
            if tok in self.target.eos_ids:
                return emitted[: j + 1][:remaining], True
        return emitted[:remaining], len(emitted) >= remaining

    def _draft_budget(self, plan: Plan | None, config: DecodeConfig) -> int:
        """Most tokens to draft this step (0: a plain target step)."""
        remaining = config.max_new_tokens - self.stats.new_tokens
        if plan is None or remaining <= 1:
            return 0
        k_max = min(config.draft_len, remaining - 1)
        return plan.budget.plan(k_max) if plan.budget is not None else k_max

    def _target_step(self, ids: list[int], config: DecodeConfig, cost_aware: bool = False, rows: RowRequest | None = None):
        t0 = time.perf_counter()
        verdict = self.verifier.verify(ids, None, config, rows)
        nxt, logits = verdict.next_token, verdict.rows
        seconds = time.perf_counter() - t0
        self.stats.verify_s += seconds
        self.stats.plain_steps += 1
        if cost_aware and self.stats.steps > 0:  # the first step also read the prompt
            self.budget.observe_plain(seconds)
        self.stats.steps += 1
        self.stats.target_forwards += 1
        return *self._finish([nxt], config.max_new_tokens - self.stats.new_tokens), logits

    def _rebuild_context(self, ids: list[int]) -> DrafterContext:
        """The drafter's context after plain steps, rebuilt from the text once drafting resumes
        (plain steps on a compute-bound target must not pay for a drafter they do not use)."""
        t0 = time.perf_counter()
        ctx = DrafterContext(self.bridge, ids)
        self.stats.bridge_s += time.perf_counter() - t0
        return ctx

    def _speculative_step(self, ids: list[int], ctx: DrafterContext, plan: Plan, config: DecodeConfig,
                          budget: int, rows: RowRequest | None):
        remaining = config.max_new_tokens - self.stats.new_tokens
        t0 = time.perf_counter()
        draft = self.drafter.draft(ctx.ids, budget, plan.policy)
        t1 = time.perf_counter()
        tr = plan.translator.forward(ids, draft)
        proposal = Proposal(draft, tr, tr.target_ids[: remaining - 1], plan.translator)
        t2 = time.perf_counter()
        verdict = self.verifier.verify(ids, proposal, config, rows)
        n, nxt, logits = verdict.accepted, verdict.next_token, verdict.rows
        t3 = time.perf_counter()
        emitted, done = self._finish(proposal.proposed[:n] + [nxt], remaining)
        if plan.budget is not None:
            kept = plan.translator.drafted_kept(draft, tr, n, proposal.proposed)
            plan.budget.observe_step(len(draft.tokens), t1 - t0, len(proposal.proposed),
                                     t3 - t2 if self.stats.steps > 0 else None, kept, plan.policy.stop.probs)
        self._count(proposal, n)
        if not done:  # reverse translation (Algorithm 1, lines 17-19)
            plan.translator.reverse(ctx, draft, tr, emitted, n)
        t4 = time.perf_counter()
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += t3 - t2
        self.stats.bridge_s += (t2 - t1) + (t4 - t3)
        return emitted, done, logits

    def _count(self, proposal: Proposal, accepted: int) -> None:
        s, proposed = self.stats, len(proposal.proposed)
        s.steps += 1
        s.target_forwards += 1
        s.drafted_tokens += len(proposal.draft.tokens)
        s.proposed_tokens += proposed
        s.accepted_tokens += accepted
        if proposed:
            s.step_rates.append(accepted / proposed)
        hits, hits_accepted = proposal.translator.ngram_hits(proposal.draft, proposal.translation, proposed, accepted)
        s.ngram_hits_proposed += hits
        s.ngram_hits_accepted += hits_accepted

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
