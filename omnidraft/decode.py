"""The decoding loop: speculative decoding over draft sources (OmniDraft Algorithm 1).

One step (:meth:`SpeculativeDecoder.step`), top to bottom:

1. draft: the draft sources (prompt lookup in the context, the lookup history, the model drafter:
   ``omnidraft/sources``) each offer what they could propose, and the policy picks at most one
   offer (the cost policy: the one expected to emit the most tokens per second), which proposes
   up to k target ids. None: a plain target step. On the step that reads the request's new text
   the policy may leave the first token to the target (``SourcePolicy.may_draft_first``): a
   drafter far behind would read all of that text first;
2. verify: one target forward scores the unread context and the proposals, and the verification
   rule keeps n of them and picks the next token (where the target runs: ``target/base.py``);
3. accept: the kept proposals plus that token, cut at end-of-sequence and at ``max_new_tokens``;
4. context sync: every source follows the emitted text (the drafter's context by reverse
   translation), and the one that drafted learns from the verdict.

A target that streams its own decode (a server over ``Decode``: ``rpc/streaming.py``) runs the
steps itself, the device drafting ahead of it; each of its forwards comes back as a step all the same.

The step returns a :class:`~omnidraft.sources.base.StepResult`; :meth:`SpeculativeDecoder._account`
is the one place that turns it into stats and into what the cost policy learns. With no source it
is plain target decoding on the same engine, which is what speedups are measured against.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields

from omnidraft.config import DecodeConfig
from omnidraft.console import Utf8Stream
from omnidraft.drafter import Drafter
from omnidraft.errors import OmnidraftError
from omnidraft.ngram.trie import NgramCache, NgramTrie
from omnidraft.observer import DecodeObserver
from omnidraft.sources import SOURCES, DraftSource, Offer, Parts, StepResult, StepTimes
from omnidraft.sources.history import LookupHistory
from omnidraft.sources.policy import AheadPolicy, CostPolicy, NoCostPolicy, SourcePolicy
from omnidraft.target import Target
from omnidraft.target.base import LocalVerifier, RowRequest, Verifier, cut
from omnidraft.verify.tree import fit_branches
from omnidraft.vocab.bridge import VocabBridge
from omnidraft.vocab.token_bytes import build_token_table


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
    branch_rows: int = 0  # rows the drafter's runner-up branches added to verifies
    branch_steps: int = 0  # steps whose kept proposals ended on a branch
    new_tokens: int = 0
    ngram_cache_entries_at_start: int = 0
    ngram_cache_entries_at_end: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    catch_up_s: float = 0.0  # of draft_s: the drafter reading text other steps emitted before drafting again
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


@dataclass
class DecodeResult:
    text: str
    token_ids: list[int]
    stats: DecodeStats


class SpeculativeDecoder:
    """Target (+ draft sources) with the loop as a generator and as a call."""

    def __init__(self, target: Target | Verifier, drafter: Drafter | None = None,
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
        self.verifier: Verifier = target if isinstance(target, Verifier) else LocalVerifier(target)
        self.ngrams = ngrams if ngrams is not None else (NgramTrie() if drafter is not None else None)
        self.stats = DecodeStats()
        self.observers: list[DecodeObserver] = []
        self._token_bytes: list[bytes | None] | None = None
        self.cost_policy = CostPolicy()  # measured costs and acceptance, kept across requests
        self.use_lookup = drafter is not None if lookup is None else lookup
        self.history = history
        parts = Parts(target, self.verifier, drafter, bridge, self.ngrams, history, self.use_lookup)
        self.sources: list[DraftSource] = [s for build in SOURCES if (s := build(parts)) is not None]

    def source(self, name: str) -> DraftSource | None:
        """The draft source called ``name`` ("context", "history", "drafter"), if this decoder has it."""
        return next((s for s in self.sources if s.name == name), None)

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

    def stream_ids(self, prompt_ids: Sequence[int], config: DecodeConfig) -> Iterator[list[int]]:
        """Yield the target token ids emitted by each step; ``self.stats`` fills in as it runs."""
        config.validate()
        if not prompt_ids:
            raise OmnidraftError("the prompt is empty")
        self.check_length(len(prompt_ids), config.max_new_tokens)
        ids = list(prompt_ids)
        streaming = getattr(self.verifier, "streams", False)  # the target streams its decode (rpc/streaming.py)
        # the sources this request drafts with, and the policy that weighs them (one choice per request)
        policy: SourcePolicy = (AheadPolicy() if streaming else self.cost_policy if config.draft_stop == "auto"
                                and self.sources else NoCostPolicy())
        rows = next((o.row_request for o in self.observers if o.row_request is not None), None)
        observers = list(self.observers)
        self.stats = DecodeStats()
        # A request starts before anything plans it: the adapter slot takes the trainer's newest version
        # here, so the policy's weights choice and the sources' plans (the stop rule's acceptance head)
        # see it whatever the stop rule; from here on on_finish runs however the request ends.
        for obs in observers:
            obs.on_start(ids)

        def between() -> None:  # the only moment drafter weights may change
            for obs in observers:
                obs.before_step()

        sources: list[DraftSource] = []
        steps: Iterator[StepResult] | None = None  # None: the request failed before its first step
        try:
            policy.prepare()  # the drafter weights of this request, before the sources plan their drafts with them
            sources = policy.order([s for s in self.sources if s.begin(ids, config, policy)])
            if self.ngrams is not None:
                self.stats.ngram_cache_entries_at_start = len(self.ngrams)
            if sources and policy.needs_measuring:
                self.stats.measure_s = self.cost_policy.measure(self.verifier, self.drafter, self.bridge, ids)
            start = time.perf_counter()
            steps = (self.verifier.steps(ids, sources, policy, config, rows, between) if streaming
                     else self._steps(ids, sources, policy, config, rows, between))
            reads_prompt = True  # the first verify also reads the prompt: its time says nothing about V
            for step in steps:
                self._account(step, policy, reads_prompt)
                reads_prompt = False
                for obs in observers:
                    obs.on_step(step.rows, step.emitted)
                ids.extend(step.emitted)
                self.stats.wall_s = time.perf_counter() - start
                yield step.emitted
                if step.done:
                    break
        finally:
            if steps is not None:
                steps.close()  # a stream still open is cancelled
                self.verifier.settle(ids)
                self.stats.wall_s = time.perf_counter() - start
            if self.ngrams is not None:
                self.ngrams.flush()
                self.stats.ngram_cache_entries_at_end = len(self.ngrams)
            if self.stats.new_tokens:
                for source in sources:
                    source.finish(len(prompt_ids), ids)
            policy.save()
            for obs in observers:
                obs.on_finish()

    # ---- one step ------------------------------------------------------------------------------
    def _steps(self, ids: list[int], sources: Sequence[DraftSource], policy: SourcePolicy, config: DecodeConfig,
               rows: RowRequest | None, between: Callable[[], None]) -> Iterator[StepResult]:
        """The request's steps, one after another; the caller appends each one's tokens to ``ids``."""
        first = True  # the step that reads the request's new text
        while self.stats.new_tokens < config.max_new_tokens:
            between()
            step = self.step(ids, sources, policy, config, rows, first=first)
            first = False
            yield step
            if step.done:
                return

    def step(self, ids: list[int], sources: Sequence[DraftSource], policy: SourcePolicy, config: DecodeConfig,
             rows: RowRequest | None, first: bool = False) -> StepResult:
        """One speculative step after the context ``ids`` (see the module docstring). ``first``: the
        step that reads the request's new text (``SourcePolicy.may_draft_first``)."""
        room = config.max_new_tokens - self.stats.new_tokens - 1  # proposals that fit: the last token is the target's
        times = StepTimes()
        # 1) draft: the offer the policy takes (none, or no room: a plain target step)
        offers = self._offers(ids, sources, room)
        if first:
            offers = [(source, offer) for source, offer in offers if policy.may_draft_first(offer, source.free)]
        chosen, k = policy.choose([(offer, source.free) for source, offer in offers])
        source, offer, proposal = None, None, None
        if chosen >= 0:
            source, offer = offers[chosen]
            proposal = source.draft(ids, offer, k, times)
            proposal.proposed = proposal.proposed[:room]
            proposal.branches = fit_branches(proposal.branches, len(proposal.proposed), room)
        # 2) verify: one target forward over the unread context and the proposals; the rule decides
        t0 = time.perf_counter()
        verdict = self.verifier.verify(ids, proposal, config, rows)
        times.verify_s = time.perf_counter() - t0
        # 3) accept: the proposals the rule kept, then its own token; cut at end-of-sequence and max_new_tokens
        proposed = proposal.proposed if proposal is not None else []
        kept = verdict.path if verdict.path is not None else proposed[: verdict.accepted]
        emitted, done = cut(kept + [verdict.next_token], self.target.eos_ids, room + 1)
        drafted = len(proposal.draft.tokens) if proposal is not None and proposal.draft is not None else len(proposed)
        step = StepResult(source=source.name if source else None, key=offer.key if source else "",
                          free=source is not None and source.free, proposal=proposal, drafted=drafted,
                          accepted=verdict.accepted, emitted=emitted, done=done, rows=verdict.rows, times=times,
                          kept=verdict.accepted, branch_kept=verdict.branch_kept)
        # 4) context sync: every source follows the text; the one that drafted learns from the verdict
        t1 = time.perf_counter()
        for s in sources:
            s.accept(step)
        times.translate_s += time.perf_counter() - t1
        return step

    @staticmethod
    def _offers(ids: list[int], sources: Sequence[DraftSource], room: int) -> list[tuple[DraftSource, Offer]]:
        """What each source could propose now. Of the free sources only the first match is offered:
        the context before the history."""
        offers: list[tuple[DraftSource, Offer]] = []
        free_offered = False
        for source in sources if room > 0 else ():
            if source.free and free_offered:
                continue
            offer = source.offer(ids, room)
            if offer is not None:
                offers.append((source, offer))
                free_offered |= source.free
        return offers

    def _account(self, step: StepResult, policy: SourcePolicy, reads_prompt: bool) -> None:
        """The one place a step is counted: the request's stats and what the policy learns."""
        policy.learn(step, reads_prompt)
        s = self.stats
        s.steps += 1
        s.target_forwards += 1
        s.new_tokens += len(step.emitted)
        s.draft_s += step.times.draft_s
        s.catch_up_s += step.times.catch_up_s
        s.verify_s += step.times.verify_s
        s.bridge_s += step.times.translate_s
        if step.source is None:
            s.plain_steps += 1
            return
        s.proposed_tokens += step.proposed
        s.accepted_tokens += step.accepted
        if step.proposed:
            s.step_rates.append(step.accepted / step.proposed)
        if step.free:  # a lookup draft: target ids, nothing drafted or translated
            s.lookup_steps += 1
            s.history_steps += step.source == "history"
            s.lookup_proposed += step.proposed
            s.lookup_accepted += step.accepted
        else:
            s.drafted_tokens += step.drafted
            s.ngram_hits_proposed += step.ngram_hits[0]
            s.ngram_hits_accepted += step.ngram_hits[1]
            s.branch_rows += step.branch_rows
            s.branch_steps += step.branch_kept > 0

    def target_token_bytes(self) -> list[bytes | None]:
        """Bytes of each target token id (None for special tokens): what streaming decodes with.

        Built once: without a bridge the table is made from the whole target vocabulary.
        """
        if self.bridge is not None:
            return self.bridge.t.token_bytes
        if self._token_bytes is None:
            self._token_bytes = build_token_table(self.target.tokenizer, self.target.vocab_size).token_bytes
        return self._token_bytes
