"""The model drafter as a draft source: a small LM drafts in its own vocabulary, a translator turns
its tokens into target ids (Algorithm 1, lines 5-9) and keeps its context in step with what the
target emitted (lines 17-19).

Per request the source picks its strategies once (:meth:`ModelDraft.plan`): the translator the
rule needs, and the drafter's sampler, constraint and stop rule. Its context follows the text: a
step it drafted is reverse-translated with the draft, a lookup step's tokens are appended, and a
plain step's tokens wait in a list until drafting resumes, when they are appended at once (plain
steps must not pay for a drafter they do not use). The context keeps the drafter's own tokens of the
text it drafted: rebuilt from the text it would be tokenized afresh, differ from what the drafter's
KV cache holds from the first drafted word on, and the drafter would read the reply again. For the
same reason a request whose prompt continues the last one's text (a chat's next turn) keeps it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from omnidraft.config import DecodeConfig
from omnidraft.drafter import Draft, Drafter, DraftPolicy, Sampler
from omnidraft.drafter.policy import stop_rule
from omnidraft.errors import OmnidraftError
from omnidraft.kv import common_prefix_len
from omnidraft.ngram.trie import NgramCache
from omnidraft.sources.base import Offer, Parts, StepResult, StepTimes
from omnidraft.sources.policy import DRAFTER
from omnidraft.verify import rule_info
from omnidraft.verify.proposal import Proposal
from omnidraft.vocab.bridge import Translation, VocabBridge
from omnidraft.vocab.reverse import DrafterContext
from omnidraft.vocab.slrs import StringTranslator, check_lookahead
from omnidraft.vocab.translate import (
    BranchingTranslator,
    HealingTranslator,
    RedistributingTranslator,
    TextTranslator,
    TokenTranslator,
    Translator,
    note_ngram_verdicts,
)

if TYPE_CHECKING:
    from omnidraft.sources.policy import SourcePolicy
    from omnidraft.target.base import Verifier

NO_DRAFT = Draft([], None)
MARKS_KEPT = 256  # places where context and text last agreed (a reply's worth of steps)
MARKS_TRIED = 4  # the latest ones checked against a prompt that departs from the text


@dataclass
class Plan:
    """The strategies of one request, chosen once from its config."""

    translator: Translator
    policy: DraftPolicy
    heals: bool = False  # token healing: the translator carries healed drafts and the request wants them


class ModelDraft:
    """The drafter, its vocabulary bridge and the translators between them (one per kind)."""

    name, free = DRAFTER, False

    def __init__(self, parts: Parts, drafter: Drafter, bridge: VocabBridge) -> None:
        self.drafter, self.bridge, self.ngrams = drafter, bridge, parts.ngrams
        self.verifier: Verifier = parts.verifier
        self.target_vocab_size = parts.target.vocab_size
        self._translators: dict[tuple, Translator] = {}
        self._plan: Plan | None = None
        self._ctx: DrafterContext | None = None  # the text in drafter tokens, up to ``_pending``
        self._pending: list[int] = []  # target ids of plain steps, not in the context yet
        self._text: list[int] = []  # the target ids the context and ``_pending`` stand for
        # (target ids, drafter ids) where the two stood for the same text, the latest MARKS_KEPT
        self._marks: deque[tuple[int, int]] = deque(maxlen=MARKS_KEPT)
        self._behind = False  # another source's tokens joined the context since the drafter last read it
        # drafter tokens per target token of the text, from the last context built: SmolLM2 spells most
        # CJK characters as 2-3 byte tokens, so a Chinese catch-up reads ~2.5x the target's count
        self._per_target = 1.0
        self._k_max = 0
        self._policy: SourcePolicy | None = None
        self._branch_cap = 0  # the request's --branch-rows (-1: the cost policy's)
        self._token_s: float | None = None  # seconds per drafted token, once timed (token_seconds)

    @classmethod
    def build(cls, parts: Parts) -> ModelDraft | None:
        return cls(parts, parts.drafter, parts.bridge) if parts.drafter is not None else None

    # ---- the source

    def begin(self, ids: list[int], config: DecodeConfig, policy: SourcePolicy) -> bool:
        generator = torch.Generator().manual_seed(config.seed)  # the drafter's sampling (verification: step_generator)
        self._plan = self.plan(config, generator, policy)
        self._k_max = config.draft_len
        self._policy, self._branch_cap = policy, config.branch_rows
        # the prompt in drafter tokens, not read yet: the first draft's read of it is a catch-up, and its
        # size is what the offers charge for it. A prompt that continues the last request's text (a chat's
        # next turn) keeps that context, and with it the drafter's own tokens of the last reply
        self._follow(ids)
        self._behind = True
        return True

    def offer(self, ids: list[int], room: int) -> Offer:
        # behind the text after plain steps (the text it has not seen, in its own tokens as estimated
        # from the last context) or after lookup steps (the tokens they emitted, already in the context)
        cached = len(self.drafter.lm.cached_ids)
        if self._ctx is not None and not cached:
            # its cache was dropped (new adapter weights: ``AdapterSlot``): the whole context is unread,
            # and reading it is a catch-up; counted as drafting, one such read inflated d for good
            self._behind = True
        if self._ctx is None or len(self._text) != len(ids):
            unread = max(round(len(ids) * self._per_target) - cached, 0)
        elif self._behind:  # what the drafter's window holds past its cache (``Drafter.unread``)
            length = len(self._ctx.ids) + round(len(self._pending) * self._per_target)
            unread = self.drafter.unread(length, self._k_max)
        else:
            unread = 0
        return Offer(self.name, min(self._k_max, room), unread=unread, room=room)

    def draft(self, ids: list[int], offer: Offer, k: int, times: StepTimes) -> Proposal:
        t0 = time.perf_counter()
        # plain or lookup steps went by, or new weights dropped its cache: the drafter first reads what
        # it has not seen, a catch-up, not the cost of drafting (counted in d, it would make every
        # later draft look dearer)
        resumed = self._behind or not self.drafter.lm.cached_ids
        context = self._context(ids)
        self._behind = False
        read, heal = self._healed(context.ids)
        t1 = time.perf_counter()
        draft = self.drafter.draft(read, k, self._plan.policy, first=heal[1] if heal else None)
        if heal:
            draft.overlap = heal[0]
        t2 = time.perf_counter()
        translator = self._plan.translator
        tr = translator.forward(ids, draft)
        branches = []
        if draft.runners_up:  # the plan asked for them: a BranchingTranslator
            rows = self._policy.branch_rows(len(tr.target_ids), self._branch_cap)
            branches = translator.branches(ids, draft, tr, rows) if rows > 0 else []
        times.draft_s += t2 - t1
        if resumed:
            times.catch_up_s += draft.read_s
            times.catch_up_tokens += draft.read_tokens
        times.translate_s += (t1 - t0) + (time.perf_counter() - t2)
        return Proposal(tr.target_ids, draft, tr, translator, branches)

    def read(self, ids: list[int], k: int, limit: int, cap: bool = True) -> int:
        """Read up to ``limit`` drafter tokens of what a draft of ``k`` on ``ids`` would read first (a
        prompt's catch-up); how many it would still read beyond ``limit`` (``Drafter.read``; ``cap``
        as there). The streaming device reads a long prompt this way, so that a stream that ends
        meanwhile waits for one piece, not the whole read."""
        return self.drafter.read(self._healed(self._context(ids).ids)[0], k, limit, cap)

    def _healed(self, context: list[int]) -> tuple[list[int], tuple[bytes, torch.Tensor] | None]:
        """What a draft after the drafter ids ``context`` reads, and its token healing (``vocab/healing.py``)
        where the request's translator carries healed drafts: the bytes of the context's last (whitespace)
        token, which the draft spells again as the drafter would, and the first token's bias."""
        if self._plan is None or not self._plan.heals:  # (a chat reads ahead before its next request begins)
            return context, None
        heal = self._plan.translator.heal(context, self.drafter.lm.vocab_size)
        keep = getattr(self.drafter.lm, "keep_rows", None)  # a pruned head: the healed token must stay proposable
        if heal and keep is not None:
            keep(context[-1:])
        return (context[:-1] if heal else context), heal

    def token_seconds(self, ids: list[int]) -> float:
        """Seconds per token the drafter takes to draft here, timed once: the better of two steps on
        top of what it has read of the context for ``ids`` (at least its first 4 tokens), then rolled
        back to that, so its cache ends as the context's prefix it would read anyway."""
        if self._token_s is None:
            lm, context = self.drafter.lm, self.drafter.window(self._context(ids).ids, 1)
            base = context[: max(common_prefix_len(lm.cached_ids, context), min(4, len(context)))]
            if not base:
                return 0.0
            lm.logits_for(base)
            times = []
            for _ in range(2):
                start = time.perf_counter()
                lm.step(base[-1])
                times.append(time.perf_counter() - start)
            lm.logits_for(base)  # the steps' tokens dropped (the cache keeps the common prefix)
            self._token_s = min(times)
        return self._token_s

    def deepen(self, ids: list[int], proposal: Proposal, index: int, k: int) -> Proposal | None:
        """A fork of ``proposal`` (drafted after ``ids``) for a target that may correct it at drafted
        position ``index``: the drafter takes its runner-up there and drafts up to ``k`` more tokens
        (``rpc/streaming.py``). None where no runner-up was noted."""
        draft = proposal.draft
        other = draft.runners_up[index] if draft is not None and index < len(draft.runners_up) else -1
        if other < 0:
            return None
        path = Draft(list(draft.tokens[:index]) + [other], None, draft.context, runners_up=[-1] * (index + 1),
                     overlap=draft.overlap)
        return self.extend(ids, Proposal([], path), k)

    def extend(self, ids: list[int], proposal: Proposal, k: int) -> Proposal:
        """``proposal`` (drafted after ``ids``, off the line) drafted up to ``k`` tokens further: its
        ``proposed`` are all its target ids after ``ids``, and its draft notes the runner-ups of the
        new tokens, where it may fork again. The drafter's own context is left as it was: the line's
        next draft re-reads only what this one's cache does not share with it."""
        draft = proposal.draft
        more = self.drafter.draft_after(list(draft.context) + draft.tokens, k, self._plan.policy)
        tokens = draft.tokens + more.tokens
        longer = Draft(tokens, None, draft.context, len(tokens), runners_up=draft.runners_up + more.runners_up,
                       overlap=draft.overlap)
        return Proposal(self.bridge.forward_text(ids, tokens, overlap=draft.overlap).target_ids, longer)

    def _context(self, ids: list[int]) -> DrafterContext:
        """The drafter's context for the text ``ids``, the tokens it has not taken in yet appended."""
        if self._ctx is None or len(self._text) != len(ids):  # the steps' own text is not compared again
            self._follow(ids)
        if self._pending:
            self._ctx.append_text(self._pending)
            self._pending = []
            self._mark()
        return self._ctx

    def _follow(self, ids: list[int]) -> None:
        """Make the context stand for the text ``ids``: the tokens past the text it stands for wait in
        ``_pending`` where ``ids`` continues that text; otherwise it is built anew."""
        n = len(self._text)
        if self._ctx is not None and len(ids) >= n and ids[:n] == self._text:
            self._pending += ids[n:]
            self._text += ids[n:]
        elif not self._keep_prefix(ids):
            self._build_context(ids)

    def _keep_prefix(self, ids: list[int]) -> bool:
        """Keep the context up to the last mark within the text ``ids`` shares with it (a chat's next turn
        re-renders the last reply, which may differ from the emitted ids near its end); False: none fits."""
        shared = common_prefix_len(ids, self._text)
        spell = self.bridge.drafter_bytes
        for text_len, ctx_len in [m for m in self._marks if 0 < m[0] <= shared][-MARKS_TRIED:][::-1]:
            head = self._ctx.ids[:ctx_len]
            if b"".join(spell(t) or b"" for t in head) == b"".join(self.bridge.target_bytes(t) or b"" for t in ids[:text_len]):
                self._ctx.truncate(ctx_len)
                self._marks = deque((m for m in self._marks if m[0] <= text_len), maxlen=MARKS_KEPT)
                self._pending, self._text = list(ids[text_len:]), list(ids)
                return True
        return False

    def _build_context(self, ids: list[int]) -> None:
        """The drafter's context for the text ``ids``, and the drafter tokens per target token it took."""
        self._ctx = DrafterContext(self.bridge, ids)
        self._pending, self._text = [], list(ids)
        self._marks = deque([(len(ids), len(self._ctx.ids))], maxlen=MARKS_KEPT)
        self._per_target = len(self._ctx.ids) / max(len(ids), 1)

    def _mark(self) -> None:
        """Note that the context stands for the text as it is now (no tokens pending)."""
        self._marks.append((len(self._text), len(self._ctx.ids)))

    def accept(self, step: StepResult) -> None:
        translator = self._plan.translator
        self._text += step.emitted
        in_step = not step.done and not self._pending  # else the tokens wait, in the text's order
        if step.source == self.name:
            p = step.proposal
            kept_ids = step.emitted if step.branch_kept else p.proposed  # a branch's path is not the chain
            step.kept = translator.drafted_kept(p.draft, p.translation, step.accepted, kept_ids)
            on_chain = step.accepted - step.branch_kept
            step.ngram_hits = note_ngram_verdicts(self.ngrams, p.draft, p.translation, step.proposed, on_chain)
            if not self._pending:  # reverse translation (Algorithm 1, lines 17-19); after the last step too:
                # a chat's next turn continues this text, and the drafter's cache holds these tokens
                translator.reverse(self._ctx, p.draft, p.translation, step.emitted, step.accepted)
                self._mark()
                return
        elif step.source is not None and in_step:  # another source's target ids: the context follows the text
            translator.reverse(self._ctx, NO_DRAFT, Translation(), step.emitted, 0)
            self._behind = True
            self._mark()
            return
        # a plain step, the request's last step, or anything after plain steps: appended when drafting resumes
        self._pending += step.emitted
        self._behind = True

    def finish(self, prompt_len: int, ids: list[int]) -> None:
        save = getattr(self.drafter.lm, "save_head_vocab", None)  # a backend that keeps what the home has seen
        if save is not None:
            save()

    # ---- strategies

    def plan(self, config: DecodeConfig, generator: torch.Generator, policy: SourcePolicy) -> Plan:
        """The translator and draft policy ``config`` asks for."""
        info = rule_info(config.verify)
        rules = self.verifier.rules
        if rules is not None and config.verify not in rules:
            raise OmnidraftError(f"--verify {config.verify} needs the drafter's distribution next to the target; this "
                                 f"target verifies {' or '.join(rules)}")
        translation = info.translations[0] if config.translate == "auto" else config.translate
        translator = self.translator(translation, config.use_ngram and info.uses_ngrams, config.use_ngram,
                                     config.slrs_lookahead)
        sampler = Sampler(config.temperature if info.keeps_q else 0.0, config.top_p, info.keeps_q, generator)
        head = self.drafter.head if config.use_head else None
        stop = policy.stop_rule(config.draft_len, head) or stop_rule(
            config.draft_stop, head, config.draft_confidence, config.stop_gamma)
        if config.use_head and hasattr(stop, "head_of"):  # the cost policy may switch weights within the request
            stop.head_of = lambda: self.drafter.head
        draft_policy = translator.draft_policy(sampler, stop, self.drafter.lm.vocab_size)
        # token trees: greedy, a translator that can branch, and an engine that reads trees or a server that
        # takes forks of a streamed draft (the device deepens them in its idle time: ``deepen``)
        takes_branches = getattr(self.verifier, "trees", False) or getattr(self.verifier, "streams", False)
        draft_policy.runners_up = (config.verify == "greedy" and policy.may_branch(config.branch_rows)
                                   and isinstance(translator, BranchingTranslator) and takes_branches)
        return Plan(translator, draft_policy, config.heal and isinstance(translator, HealingTranslator))

    def translator(self, translation: str, propose_ngrams: bool, learn_ngrams: bool, lookahead: int = 1) -> Translator:
        """One translator per kind, kept for the source's life (they hold masks and memos)."""
        key = (translation, propose_ngrams and translation == "tokens", learn_ngrams, lookahead if translation == "strings" else 0)
        if key not in self._translators:
            self._translators[key] = self._new_translator(translation, key[1], learn_ngrams, lookahead)
        return self._translators[key]

    def _new_translator(self, translation: str, propose_ngrams: bool, learn_ngrams: bool, lookahead: int) -> Translator:
        learn: NgramCache | None = self.ngrams if learn_ngrams else None
        if translation == "text":
            return TextTranslator(self.bridge, learn)
        if translation == "rdk":
            return RedistributingTranslator(self.bridge, self.target_vocab_size, learn)
        if translation == "strings":
            check_lookahead(self.bridge, lookahead)  # refused where ψ would blow up (SLRS §3.4)
            return StringTranslator(self.bridge, self.target_vocab_size, learn, lookahead, self.drafter)
        return TokenTranslator(self.bridge, self.target_vocab_size, self.ngrams if propose_ngrams else None, learn)
