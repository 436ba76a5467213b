"""The interface every way of drafting implements, and what one step hands back.

A draft source (after llama.cpp's ``common/speculative.cpp``, where n-gram lookup, a draft model,
EAGLE3 and MTP are peers) answers four calls:

- ``begin(ids, config, policy)``: a request starts; whether the source takes part in it;
- ``offer(ids, room)``: what it could propose now — an :class:`Offer` with the policy's key for it
  and how many tokens at most — or None. A lookup source looks its match up here (that is free);
  the model drafter offers without drafting;
- ``draft(ids, offer, k, times)``: the proposal, up to ``k`` target ids (for the model drafter: its
  own tokens plus their translation, carried on the :class:`~omnidraft.verify.proposal.Proposal`);
- ``accept(step)``: every source sees every verified step (the context sync), whoever drafted it;
  the one that drafted it also learns from the verdict, and notes on the step how many of its own
  drafted tokens the accepted proposals cover (what the cost policy learns from).

``finish(prompt_len, ids)`` ends a request. The decoder keeps the counters, once, for all sources
(:class:`StepResult`), and the cost policy decides which source drafts and how much.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from omnidraft.config import DecodeConfig
from omnidraft.costs import EVEN_PRIOR, Prior
from omnidraft.verify import rule_info
from omnidraft.verify.proposal import Proposal
from omnidraft.verify.tree import rows_of

if TYPE_CHECKING:
    import torch

    from omnidraft.drafter import Drafter
    from omnidraft.ngram.trie import NgramCache
    from omnidraft.sources.history import LookupHistory
    from omnidraft.sources.policy import SourcePolicy
    from omnidraft.target import Target
    from omnidraft.target.base import SparseRows, Verifier
    from omnidraft.vocab.bridge import VocabBridge


@dataclass
class Offer:
    """What a source could propose this step, before the policy decides how much of it to take."""

    key: str  # the policy's acceptance key: "drafter", or a lookup source and its match length
    limit: int  # most tokens it can propose now
    ids: list[int] = field(default_factory=list)  # a lookup's target ids (free to look up)
    unread: int = 0  # tokens the source must read before its first one (a drafter behind the text)
    room: int = 0  # tokens the request may still emit (0: not known): what a catch-up read pays back over
    prior: Prior = EVEN_PRIOR  # this key's acceptance before any evidence (a long lookup match: high)


@dataclass
class StepTimes:
    draft_s: float = 0.0  # the source drafting
    translate_s: float = 0.0  # vocabulary bridging: forward translation and the context sync
    verify_s: float = 0.0  # the target's forward and the rule
    catch_up_s: float = 0.0  # the part of draft_s spent reading text the drafter skipped (other sources' steps)
    catch_up_tokens: int = 0  # how many tokens that read was


@dataclass
class StepResult:
    """One step, as the decoder accounts for it and the policy learns from it."""

    source: str | None  # the source that drafted (None: a plain target step)
    key: str  # its policy key ("" for a plain step)
    free: bool  # the source proposes target ids at no drafting cost (a lookup)
    proposal: Proposal | None
    drafted: int  # tokens the source drafted in its own tokens (a lookup: the proposed ids)
    accepted: int  # proposals the rule kept
    emitted: list[int]  # the accepted proposals and the target's own token, cut at EOS and at max_new_tokens
    done: bool  # the request ends with this step
    rows: torch.Tensor | SparseRows | None  # the target's rows before each emitted token (observers)
    times: StepTimes
    kept: int = 0  # drafted tokens covered by the accepted proposals (set by the drafting source)
    ngram_hits: tuple[int, int] = (0, 0)  # proposals from the n-gram cache, of which accepted
    branch_kept: int = 0  # of the accepted proposals, those from one of the proposal's branches (at its end)

    @property
    def proposed(self) -> int:
        return len(self.proposal.proposed) if self.proposal is not None else 0

    @property
    def branch_rows(self) -> int:
        """Rows the proposal's branches added to the verify."""
        return rows_of(self.proposal.branches) if self.proposal is not None else 0

    @property
    def draft_s(self) -> float:
        return self.times.draft_s

    @property
    def verify_s(self) -> float:
        return self.times.verify_s


@dataclass
class Parts:
    """What a source may be built from: the decoder's components (a source takes what it needs)."""

    target: Target
    verifier: Verifier
    drafter: Drafter | None
    bridge: VocabBridge | None
    ngrams: NgramCache | None
    history: LookupHistory | None
    lookup: bool  # prompt lookup is wanted where the rule allows it


class DraftSource(Protocol):
    """One way to draft (see the module docstring)."""

    name: str  # "context", "history", "drafter": the stats and the policy keys say it
    free: bool  # proposes target ids at no drafting cost; only the first free match is weighed

    def begin(self, ids: list[int], config: DecodeConfig, policy: SourcePolicy) -> bool: ...
    def offer(self, ids: list[int], room: int) -> Offer | None: ...
    def draft(self, ids: list[int], offer: Offer, k: int, times: StepTimes) -> Proposal: ...
    def accept(self, step: StepResult) -> None: ...
    def finish(self, prompt_len: int, ids: list[int]) -> None: ...


def lookup_applies(parts: Parts, config: DecodeConfig) -> bool:
    """Lookup drafts are deterministic target ids: the rules that need only ids verify them."""
    rules = parts.verifier.rules
    return (parts.lookup and config.lookup and rule_info(config.verify).ids_only
            and (rules is None or config.verify in rules))
