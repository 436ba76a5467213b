"""The cost policy: which source drafts, and how many tokens, so that tokens per second go up.

One object (:class:`CostPolicy`) does the whole job, for every draft source alike:

- **measure**: V(m), the target's seconds for a verify with m proposals (V(0) is a plain step),
  and d, the drafter's seconds per drafted token, timed once on the first request's prompt;
- **persist**: the measurements and the learned statistics go to a small JSON file under the home
  (``models/costs/``), so a later process starts from them;
- **decide**: a source may draft k tokens only when some k > 0 is expected to beat a plain step
  by a margin, E(k)/T(k) >= DRAFT_MIN_GAIN / V(0) (``costs.best_draft_length``), with a_i the
  source's own per-position acceptance (counted per source key: the drafter, and each lookup
  source and match length, since a long match continues as before far more often than a short
  one). A source that drafts token by token (the model drafter) is then stopped by
  :class:`CostAwareStop` as soon as one more token is no longer expected to pay, with that token's
  own estimate: the drafter's confidence q calibrated into an acceptance probability (counted per
  bin of q), or the acceptance head's estimate when the adapter has one (OmniDraft §3.3);
- **learn**: every verified step updates V, d and the acceptance counts (``learn``), kept per set
  of drafter weights: the base weights and the adapter each have their own (``DrafterEvidence``);
- **choose weights**: where the drafter holds an adapter, each request drafts with the adapter or
  the base weights, whichever the evidence expects to be faster (:class:`WeightsChoice`); where a
  switch is a swap, the two are compared on the same text, draft by draft (:class:`PairedTrials`);
- **explore**: a source the statistics turned off drafts anyway now and then (when drafting could
  pay at all), so the statistics follow a drafter or text that changes; each exploration that
  loses time makes the next one twice as rare (every ``EXPLORE_EVERY`` skipped steps at first, at
  most every ``EXPLORE_MAX``), and all of them together lose at most ``EXPLORE_SHARE`` of the
  steps they were asked about, so a pair where drafting never pays costs almost nothing, even in
  short requests. A drafter's exploration is priced with the whole read of the text it skipped
  (where drafting never pays, the drafter reads again at each exploration). One
  routine (:class:`Exploration`) serves every source: one schedule for the lookups, which cost
  nothing to draft, and one for the drafter. A third explores draft *lengths*: now and then a draft
  goes one token past where its stop rule ends it, so a position whose a_i a few early rejections
  pushed down is measured again.

Why V must be measured: on a memory-bound target a few-token verify costs about one step (long
drafts pay), on compute-bound CPU kernels it grows with the number of tokens, and neither is
monotone in general (docs/performance.md has the tables). :class:`NoCostPolicy` is the other
policy (``--draft-stop`` fixed, confidence, head): every source drafts what it is allowed, nothing
is measured or learned.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from omnidraft.adapter.head import AcceptHead
from omnidraft.adapter.store import BASE_WEIGHTS
from omnidraft.config import MAX_BRANCH_ROWS, DecodeConfig
from omnidraft.console import warn
from omnidraft.costs import (
    DRAFT_MIN_GAIN,
    EVEN_PRIOR,
    AcceptanceStats,
    DraftCost,
    Prior,
    SequentialDraft,
    VerifyCosts,
    best_rate,
    expected_rates,
)
from omnidraft.errors import OmnidraftError
from omnidraft.fsutil import atomic_write_json
from omnidraft.verify.proposal import Proposal
from omnidraft.vocab.reverse import DrafterContext

if TYPE_CHECKING:
    from omnidraft.drafter import Drafter
    from omnidraft.drafter.policy import StopRule
    from omnidraft.sources.base import DraftSource, Offer, StepResult
    from omnidraft.target.base import Verifier
    from omnidraft.vocab.bridge import VocabBridge

MEASURE_KS = (0, 1, 2, 3, 4, 6, 8)  # proposals per measured verify (k + 1 new tokens)
MEASURE_CONTEXT = 128  # context tokens behind the measured evals
EXPLORE_EVERY = 16  # a skipped step drafts anyway this often, when drafting could pay at all
EXPLORE_MAX = 256  # ... and, after explorations that lost time, up to this rarely (doubling each time)
EXPLORE_SHARE = 0.01  # a kind of source's explorations may lose at most this share of the steps it was on offer
STALE_COST_KEEP = 0.98  # per step the drafter sat out, the share of d's (and the read cost's) excess over its timing kept
# Catch-up reads shorter than this do not teach the read cost per token: a read of 1-2 tokens costs
# about a whole step each, one of hundreds a fraction of a step each, and the read cost prices the
# long reads (a drafter that sat out steps); short ones inflated it ~50x in a chat, which then
# priced every catch-up out
READ_SAMPLE_MIN = 32
# The first token may wait for the drafter's read of the request's new text only up to this share of a
# plain step (then come the draft and its verify rows besides): a chat message read behind a history read
# ahead still drafts at once, a new prompt's first token comes at the target's own latency
FIRST_READ_SHARE = 0.25
KEEP_ON_NEW_WEIGHTS = 0.25  # share of the drafter's acceptance evidence kept when its adapter changes
# a lookup key's evidence fades over its last ~20 drafts: whether a copy continues is a property of the
# text being written (a docstring repeated, a list that diverges every few items), not of a model
LOOKUP_DECAY = 0.95
OPTIMISTIC_ACCEPTANCE = 0.9  # "could pay at all": the best case a real drafter reaches
# ... and pay enough to be worth finding out: an exploration costs a verify and, for a drafter that sat
# out, a read of the text it skipped, which a best case of a few percent never earns back
EXPLORE_MIN_GAIN = 1.05
DRAFTER = "drafter"  # the model drafter's acceptance key (lookup keys: "context-4", "history-3", …)
STATE_FORMAT = 2
# the weights choice: after this many requests on the weights that look faster, one request runs the
# others, so a change of domain (where the adapter starts or stops paying) is noticed; each such
# request that confirms the choice doubles the gap, up to WEIGHTS_GAP_MAX
WEIGHTS_GAP_MIN = 4
WEIGHTS_GAP_MAX = 32
# paired trials (where a switch of weights is a swap): drafts each weights needs in the trials' tally
# before it decides, and the share of the earlier trials' tally a new trial keeps
TRIAL_MIN_DRAFTS = 6
TRIAL_KEEP = 0.5


class ConfidenceCalibration:
    """P(a drafted token is accepted | the drafter's probability q of it), counted in bins of q.

    Each bin starts as a Beta prior centred on q itself (a drafter that is calibrated needs no
    correction) and follows the verified outcomes of its tokens.
    """

    def __init__(self, bins: int = 10, prior_strength: float = 4.0) -> None:
        self.bins = bins
        self.prior = ([(b + 0.5) / bins * prior_strength for b in range(bins)], [prior_strength] * bins)
        self.accepted, self.tried = list(self.prior[0]), list(self.prior[1])

    def discount(self, keep: float) -> None:
        """Keep the share ``keep`` of the outcomes counted on top of the prior."""
        (prior_a, prior_t) = self.prior
        self.accepted = [p + keep * (a - p) for a, p in zip(self.accepted, prior_a)]
        self.tried = [p + keep * (t - p) for t, p in zip(self.tried, prior_t)]

    def _bin(self, q: float) -> int:
        return min(int(q * self.bins), self.bins - 1)

    def __call__(self, q: float) -> float:
        b = self._bin(q)
        return self.accepted[b] / self.tried[b]

    def update(self, q: float, accepted: bool) -> None:
        b = self._bin(q)
        self.tried[b] += 1
        self.accepted[b] += float(accepted)


class Exploration:
    """When a source the statistics turned off drafts anyway (one schedule per kind of source).

    Two bounds apply. The gap: an exploration comes after ``every`` skipped steps, and each one that
    lost time doubles the gap (up to EXPLORE_MAX). The budget: all explorations together may lose at
    most EXPLORE_SHARE of the steps this schedule was asked about (steps where its kind of source had
    a draft to offer), in plain steps net of what explorations won, and an exploration drafts no more
    than the budget left could lose. The gap alone let a short request on a target whose every
    verified row costs a step (llama.cpp on a CPU) lose several percent to its first exploration;
    with the budget it explores once enough was decoded for one lost exploration to be a small
    share, and then with the length the budget affords.
    """

    def __init__(self, share: float = EXPLORE_SHARE) -> None:
        self.every = EXPLORE_EVERY
        self.since = 0  # skipped steps since the last exploration
        self.active = False  # the current step is an exploration
        self.share = share
        self.steps = 0  # steps this schedule was asked about (drafted, explored or not)
        self.lost = 0.0  # plain steps' worth of time the explorations lost (negative: won)

    @property
    def room(self) -> float:
        """Plain steps' worth of time an exploration may lose now (unbounded without a budget)."""
        return math.inf if math.isinf(self.share) else self.share * self.steps - self.lost

    def tally(self, k: int) -> None:
        """A step this schedule was asked about whose source was decided without exploring: ``k`` it
        was allowed (0: it would not pay, which counts toward the next exploration)."""
        self.active = False
        self.steps += 1
        if not k:
            self.since += 1

    def choose(self, k: int, explore_k: Callable[[float], int]) -> int:
        """``k`` as decided, or, when a skipped step is due to explore, ``explore_k(room)``: the length
        that would pay if the source were as good as a real one gets, among those whose loss, should
        every token be rejected, fits in ``room`` plain steps (0: none, do not explore now). On a
        target whose verify grows with every row, that keeps an exploration that loses cheap."""
        self.tally(k)
        if k or self.since < self.every:
            return k
        k = explore_k(self.room)
        if k:
            self.since, self.active = 0, True  # the statistics must see drafts to notice that they could pay
        return k

    def skip(self) -> None:
        """A step with nothing to explore with (no draft at hand) still counts toward the next exploration."""
        self.tally(0)

    @property
    def due(self) -> bool:
        """The gap has passed: the next skipped step explores, if drafting could pay at all and the
        budget affords it (what ``explore_k`` says)."""
        return self.since + 1 >= self.every

    def settle(self, lost_steps: float) -> None:
        """After an exploration that lost ``lost_steps`` plain steps' worth of time (negative: it won):
        one that lost makes the next twice as rare, one that paid resets the gap."""
        if self.active:
            self.lost += lost_steps
            self.every = EXPLORE_EVERY if lost_steps <= 0 else min(2 * self.every, EXPLORE_MAX)
            self.active = False

    def cancel(self) -> None:
        """The exploration chosen this step did not happen (the draft ended before it): nothing to settle."""
        self.active = False

    def restart(self) -> None:
        """Explore again within EXPLORE_EVERY steps (the source changed): the gap starts again and
        what the budget owes is forgiven, since those explorations tried the old source; the budget
        earned carries on."""
        self.every, self.since = EXPLORE_EVERY, 0
        if math.isfinite(self.share):
            self.lost = min(self.lost, self.share * self.steps)

    def state(self) -> list[float]:
        return [self.steps, self.lost]

    def restore(self, saved: object) -> None:
        """Take a saved ``state()``; anything malformed leaves a fresh budget."""
        if (isinstance(saved, list) and len(saved) == 2 and all(isinstance(x, (int, float)) for x in saved)
                and saved[0] >= 0 and math.isfinite(saved[1])):
            self.steps, self.lost = int(saved[0]), float(saved[1])


def explore_length(d: float, costs: Callable[[int], float], k_max: int, room: float, catch_up: float = 0.0,
                   read: float = 0.0) -> int:
    """The length an exploration drafts: the best one at OPTIMISTIC_ACCEPTANCE among those whose
    worst case (every token rejected: ``read`` seconds to catch up, then V(k) + k d - V(0)) loses at
    most ``room`` plain steps; 0 where even that best case, paying ``catch_up`` seconds per emitted
    token for the read (spread over the tokens it pays back over), would beat a plain step by less
    than EXPLORE_MIN_GAIN."""
    v0, cap = costs(0), 0
    for k in range(1, k_max + 1):
        if read + costs(k) + k * d - v0 > room * v0:
            break
        cap = k
    if not cap:
        return 0
    return best_rate(with_catch_up(expected_rates(OPTIMISTIC_ACCEPTANCE, d, costs, cap), catch_up), EXPLORE_MIN_GAIN)


def with_catch_up(rates: Sequence[float], catch_up: float) -> list[float]:
    """Tokens/s by draft length when every emitted token also pays ``catch_up`` seconds (its share of
    a read the drafter must make before drafting); a plain step (k = 0) reads nothing."""
    return [r if k == 0 or catch_up <= 0 else 1.0 / (1.0 / r + catch_up) for k, r in enumerate(rates)]


# A drafter that sat out steps reads what it skipped before it drafts. That read pays back over the
# tokens the request emits afterwards, counted up to this many (a reply often ends well before its
# limit): each emitted token is charged read / min(room, CATCH_UP_HORIZON).
CATCH_UP_HORIZON = 64


@dataclass
class DrafterEvidence:
    """What the policy has learnt about one set of drafter weights (the base weights, or an adapter
    version): its per-position acceptance, its confidence calibration, d and the read cost, and the
    costs this process timed for it. ``requests``: requests that drafted with these weights; 0 means
    every number here was inherited from other weights (a new adapter version), not observed."""

    stats: AcceptanceStats
    calibration: ConfidenceCalibration
    draft_cost: DraftCost
    read_cost: DraftCost
    timed: tuple[float, float] = (0.0, 0.0)
    requests: int = 0

    def state(self) -> dict:
        return {"stats": {"tried": self.stats.tried, "accepted": self.stats.accepted},
                "calibration": {"tried": self.calibration.tried, "accepted": self.calibration.accepted},
                "draft_s": self.draft_cost.seconds_per_token if self.draft_cost.known else None,
                "read_s": self.read_cost.seconds_per_token if self.read_cost.known else None,
                "requests": self.requests}

    @classmethod
    def from_state(cls, saved: object, template: DrafterEvidence) -> DrafterEvidence | None:
        """Evidence from ``state()``, shaped like ``template``; None for anything malformed."""
        try:
            tried, accepted = [float(x) for x in saved["stats"]["tried"]], [float(x) for x in saved["stats"]["accepted"]]
            c_tried = [float(x) for x in saved["calibration"]["tried"]]
            c_accepted = [float(x) for x in saved["calibration"]["accepted"]]
            draft, read, requests = saved.get("draft_s"), saved.get("read_s"), int(saved.get("requests", 0))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if not (len(tried) == len(accepted) == template.stats.max_positions
                and len(c_tried) == len(c_accepted) == template.calibration.bins and requests >= 0
                and all(0 <= a <= t for a, t in zip(accepted + c_accepted, tried + c_tried))):
            return None
        out = template.inherited(1.0)
        out.stats.tried, out.stats.accepted = tried, accepted
        out.calibration.tried, out.calibration.accepted = c_tried, c_accepted
        out.draft_cost = DraftCost(_positive(draft), alpha=0.1)
        out.read_cost = DraftCost(_positive(read), alpha=0.1)
        out.requests = requests
        return out

    def inherited(self, keep: float) -> DrafterEvidence:
        """A copy for other weights: ``keep`` of the acceptance evidence, the same costs, no requests."""
        stats, calibration = copy.deepcopy(self.stats), copy.deepcopy(self.calibration)
        stats.discount(keep)
        calibration.discount(keep)
        return DrafterEvidence(stats, calibration, copy.deepcopy(self.draft_cost), copy.deepcopy(self.read_cost),
                               self.timed, 0)


def _positive(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and x > 0 and math.isfinite(x) else None


class WeightsSwitch(Protocol):
    """What runs the drafter's weights (``AdapterSlot``): the policy picks, per request, between its
    adapter and its base weights. A switch may also say ``alternates = True``: switching back and
    forth costs nothing (a swap), so a request may alternate the two draft by draft."""

    @property
    def adapter_weights(self) -> str | None:
        """The loaded adapter's weights key (None: no adapter, nothing to choose)."""

    def run(self, weights: str) -> None:
        """Draft this request with ``weights`` (the adapter's key or BASE_WEIGHTS)."""


@dataclass
class PairedTrials:
    """The adapter against the base weights on the same text: in a trial request the two draft in
    turn, draft by draft, and each drafted step adds its emitted tokens and seconds to its weights'
    tally. Comparing whole requests instead compares texts as much as weights: one run of the base
    weights on an easy prompt, against the adapter's evidence from a hard one (or from a 16-token
    warm-up in prose), picks the slower weights for many requests (docs/performance.md). Adjacent
    drafts see nearly the same text, so what differs between the tallies is the weights, with their
    own draft lengths and costs. A new trial keeps TRIAL_KEEP of the earlier trials' tally, so the
    comparison follows the text a user writes. One adapter version at a time."""

    adapter: str
    tally: dict[str, list[float]] = field(default_factory=dict)  # weights -> [tokens, seconds, drafts]

    def add(self, weights: str, tokens: int, seconds: float) -> None:
        entry = self.tally.setdefault(weights, [0.0, 0.0, 0.0])
        entry[0] += tokens
        entry[1] += max(seconds, 0.0)
        entry[2] += 1

    def keep(self, share: float) -> None:
        for entry in self.tally.values():
            entry[:] = [x * share for x in entry]

    def winner(self) -> str | None:
        """The weights with more tokens per drafting-and-verifying second, once both have drafted
        TRIAL_MIN_DRAFTS times in the tally; None before."""
        if len(self.tally) < 2 or any(e[2] < TRIAL_MIN_DRAFTS or e[1] <= 0 for e in self.tally.values()):
            return None
        return max(self.tally, key=lambda w: self.tally[w][0] / self.tally[w][1])

    def ratio(self) -> float | None:
        """The adapter's tokens per second over the base weights' in the tally (None: one has none)."""
        a, b = self.tally.get(self.adapter), self.tally.get(BASE_WEIGHTS)
        if a is None or b is None or min(a[0], a[1], b[0], b[1]) <= 0:
            return None
        return (a[0] / a[1]) / (b[0] / b[1])

    def state(self) -> dict:
        return {"adapter": self.adapter, "tally": {w: list(e) for w, e in self.tally.items()}}

    @classmethod
    def from_state(cls, saved: object) -> PairedTrials | None:
        """None for anything malformed."""
        try:
            tally = {str(w): [float(x) for x in e] for w, e in saved["tally"].items()}
            adapter = saved["adapter"]
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if not isinstance(adapter, str) or any(w not in (adapter, BASE_WEIGHTS) for w in tally) or any(
                len(e) != 3 or not all(math.isfinite(x) and x >= 0 for x in e) for e in tally.values()):
            return None
        return cls(adapter, tally)


class WeightsChoice:
    """Which weights a request drafts with: the ones the evidence expects to draft faster, and now
    and then the others, so the choice follows the text a user writes.

    An adapter helps where it was trained and costs speed elsewhere: its LoRA branches make every
    drafted token dearer, and where its acceptance is no higher the base weights draft faster (an
    adapter trained on Japanese and tool calls drafts English code slower than they do:
    docs/online-distillation.md). A request is the unit: the
    drafter keeps one set of weights while it drafts, and a switch costs a weight swap (a pointer on
    the native and ONNX backends, a LoRA merge on torch), so the comparison is made between requests.
    Which is faster is the cost policy's own estimate for each: E(k) / T(k) at the best k, with that
    weights' per-position acceptance and d. An adapter version never drafted with yet (the trainer's
    news) runs first; the base weights, once, next.

    Where a switch is a swap (``WeightsSwitch.alternates``: the native and ONNX drafters), whole requests are not
    compared: a trial request alternates the two weights draft by draft (:class:`PairedTrials`), the
    first request of each adapter version is one, and the winner runs until the next trial, one per
    gap as above.
    """

    def __init__(self) -> None:
        self.gap = WEIGHTS_GAP_MIN  # requests on the preferred weights before the others run once
        self.since = 0
        self.trying: str | None = None  # the weights the last request tried against the preferred ones
        self.picks = {"adapter": 0, "base": 0}  # what this process's requests ran (bench reports it)
        # where the switch alternates: the paired trials' tally, what they found faster, and whether
        # the request now running is a trial
        self.trials: PairedTrials | None = None
        self.preferred: str | None = None
        self.pairing = False

    def pick(self, values: dict[str, float | None], adapter: str, alternates: bool = False) -> str:
        """``values``: each weights' expected gain over a plain step (None: never drafted with).
        ``alternates``: a switch is a swap, so the choice is made by paired trials (``pairing`` says
        whether this request is one: the policy then alternates the weights after each draft)."""
        if alternates:
            weights = self._pick_paired(adapter)
        else:
            self.pairing, weights = False, self._pick(values, adapter)
        key = "paired" if self.pairing else "base" if weights == BASE_WEIGHTS else "adapter"
        self.picks[key] = self.picks.get(key, 0) + 1
        return weights

    def _pick_paired(self, adapter: str) -> str:
        if self.trials is None or self.trials.adapter != adapter:  # a new version: compared afresh
            self.trials, self.preferred, self.pairing = PairedTrials(adapter), None, False
            self.gap, self.since = WEIGHTS_GAP_MIN, 0
        winner = self.trials.winner()
        if winner is not None and (self.pairing or self.preferred is None):  # a trial's verdict
            if self.pairing:  # did it confirm the weights it was run against?
                self.gap = min(2 * self.gap, WEIGHTS_GAP_MAX) if winner == self.preferred else WEIGHTS_GAP_MIN
            self.preferred, self.since = winner, 0
        self.pairing = self.preferred is None or self.since >= self.gap
        if self.pairing:  # a trial, until one decides, then once per gap
            if self.preferred is not None:
                self.trials.keep(TRIAL_KEEP)
            self.since = 0
            return self.preferred or adapter
        self.since += 1
        return self.preferred

    def _pick(self, values: dict[str, float | None], adapter: str) -> str:
        base_value, adapter_value = values.get(BASE_WEIGHTS), values.get(adapter)
        if adapter_value is None:
            return adapter
        if base_value is None:
            self.trying = BASE_WEIGHTS
            return BASE_WEIGHTS
        best, other = (adapter, BASE_WEIGHTS) if adapter_value >= base_value else (BASE_WEIGHTS, adapter)
        if self.trying is not None:  # the last request tried the others: did they win?
            self.gap = WEIGHTS_GAP_MIN if self.trying == best else min(2 * self.gap, WEIGHTS_GAP_MAX)
            self.trying, self.since = None, 0
        if self.since >= self.gap:
            self.trying, self.since = other, 0
            return other
        self.since += 1
        return best

    def state(self) -> list[int]:
        return [self.gap, self.since]

    def restore(self, saved: object) -> None:
        if (isinstance(saved, list) and len(saved) == 2 and all(isinstance(x, int) for x in saved)
                and WEIGHTS_GAP_MIN <= saved[0] <= WEIGHTS_GAP_MAX and saved[1] >= 0):
            self.gap, self.since = saved

    def summary(self) -> str | None:
        """What the paired trials found, for /stats and the bench (None: no trial has drafted both)."""
        ratio = self.trials.ratio() if self.trials is not None else None
        if ratio is None:
            return None
        drafts = "/".join(f"{self.trials.tally[w][2]:.0f}" for w in (self.trials.adapter, BASE_WEIGHTS))
        verdict = {None: "no verdict yet", self.trials.adapter: "the adapter runs"}.get(self.preferred,
                                                                                     "the base weights run")
        return (f"paired trials: the adapter drafts at {ratio:.2f}x the base weights' tokens/s "
                f"({drafts} drafts kept in the tally); {verdict}")

    def trials_state(self) -> dict | None:
        if self.trials is None:
            return None
        return {**self.trials.state(), "preferred": self.preferred}

    def restore_trials(self, saved: object) -> None:
        """The paired trials of a saved state; anything malformed leaves none (the next request is a trial)."""
        trials = PairedTrials.from_state(saved)
        preferred = saved.get("preferred") if isinstance(saved, dict) else None
        if trials is not None and (preferred is None or preferred in (trials.adapter, BASE_WEIGHTS)):
            self.trials, self.preferred = trials, preferred


class SourcePolicy(Protocol):
    """What the decoder asks of a policy (``CostPolicy`` or ``NoCostPolicy``)."""

    needs_measuring: bool

    def prepare(self) -> None:
        """A request starts (before its sources begin): pick the weights it drafts with."""

    def may_draft_first(self, offer: Offer, free: bool) -> bool:
        """Whether ``offer`` may draft the step that reads the request's new text (its prompt, a chat
        turn), the step whose verify emits the request's first token."""

    def order(self, sources: Sequence[DraftSource]) -> list[DraftSource]: ...
    def choose(self, offers: Sequence[tuple[Offer, bool]]) -> tuple[int, int]: ...
    def stop_rule(self, k_max: int, head: AcceptHead | None) -> StopRule | None: ...
    def learn(self, step: StepResult, reads_prompt: bool) -> None: ...
    def save(self) -> None: ...

    def may_branch(self, cap: int) -> bool:
        """Whether this policy may ever verify branch rows under the request's ``cap``: the drafter
        notes its runner-up tokens only then."""

    def branch_rows(self, proposed: int, cap: int) -> int:
        """Branch rows to verify beside a chain of ``proposed`` (``cap``: the request's limit, -1: the policy's)."""


def free_first(sources: Sequence[DraftSource]) -> list[DraftSource]:
    """Sources that cost nothing to draft are asked first, in their listed order."""
    return sorted(sources, key=lambda s: not s.free)


class NoCostPolicy:
    """A fixed stop rule (``--draft-stop fixed|confidence|head``): every source drafts what it is
    allowed, and nothing is measured or learned."""

    needs_measuring = False

    def may_draft_first(self, offer: Offer, free: bool) -> bool:
        return True  # every source drafts what it is allowed, from the first step on

    def prepare(self) -> None:
        pass  # the drafter runs the weights it was given

    def order(self, sources: Sequence[DraftSource]) -> list[DraftSource]:
        return free_first(sources)

    def choose(self, offers: Sequence[tuple[Offer, bool]]) -> tuple[int, int]:
        return (0, offers[0][0].limit) if offers else (-1, 0)  # the first source: free ones come first

    def stop_rule(self, k_max: int, head: AcceptHead | None) -> StopRule | None:
        return None  # the configured rule

    def learn(self, step: StepResult, reads_prompt: bool) -> None:
        pass

    def save(self) -> None:
        pass

    def may_branch(self, cap: int) -> bool:
        return cap > 0

    def branch_rows(self, proposed: int, cap: int) -> int:
        return max(cap, 0)  # nothing measured: only what the request asks for


class AheadPolicy(NoCostPolicy):
    """Drafting ahead of a target that streams its own decode (``rpc/streaming.py``): the drafting
    overlaps the target's forwards and delays none of them, so every source drafts what it is
    allowed, in fixed-length chunks, and the target decides how much of it to verify. Where
    ``--branch-rows`` asks for branches (``may_branch``: N > 0, as without a cost policy) the drafter
    notes its runner-ups and the device forks its line there in the time it would otherwise wait;
    not by default: with the drafters measured so far a fork's tokens past the correction it foresaw
    are kept too rarely to pay for the server's verify (docs/remote.md)."""

    def stop_rule(self, k_max: int, head: AcceptHead | None) -> StopRule:
        from omnidraft.drafter.policy import FixedLength

        return FixedLength()

    def branch_rows(self, proposed: int, cap: int) -> int:
        return 0  # the server verifies chains: a fork is a path of its own, not rows beside the chain


class CostPolicy:
    """The measured costs and acceptance statistics of one drafter–target pair on this machine."""

    def __init__(self, k_max: int = 16, path: Path | None = None) -> None:
        self.verify_costs: VerifyCosts | None = None
        self.draft_cost = DraftCost(alpha=0.1)
        self.read_cost = DraftCost(alpha=0.1)  # seconds per token the drafter reads to catch up (READ_SAMPLE_MIN)
        self.k_max = k_max
        self.acceptance: dict[str, AcceptanceStats] = {DRAFTER: AcceptanceStats(k_max, prior_mean=0.6, decay=0.995)}
        self.calibration = ConfidenceCalibration()
        # by source.free: the drafter and the lookups, each with a budget: where a verified row costs
        # most of a step (llama.cpp on a CPU), a failed lookup loses several, and a drafter's
        # exploration also reads all the text it skipped (unbudgeted, a fresh policy's first two lost
        # a short request several percent there); where verifies are flat, one costs a fraction of a step
        self.explorations = {False: Exploration(), True: Exploration()}
        # a draft the stop rule ends goes one token further now and then, on its own schedule and budget:
        # the stop rule reads the next position's a_i, which only drafts that reach it can correct, so a
        # position whose first few outcomes were bad (three rejections) would otherwise stay unvisited
        # until the decay forgot them, hundreds of steps of one-token drafts later
        self.deepening = Exploration()
        self.choices: dict[int, int] = {}  # the drafter's allowance -> steps (what the policy did)
        self.weights: str | None = None  # the drafter's adapter version its statistics describe (None: unknown)
        self.path = path  # where the state is kept (None: in memory only)
        self.machine = ""  # what the costs were measured on (CPU, kernels): other costs are measured again
        self._stale_d = False  # d came from a file: timed again at this process's first request
        self._timed = (0.0, 0.0)  # (d, read cost) as this process timed them: what costs left unobserved relax to
        self._stop: CostAwareStop | None = None
        # where the chain was first rejected at a depth a branch hangs from: whether that branch had the
        # target's token (the drafter's runner-up is right about 0.4 of the time where its first choice is not)
        self.branch_hits = AcceptanceStats(1, prior_mean=0.4, prior_strength=4.0, decay=0.99)
        # the weights choice: the evidence of the weights not running now (the base weights and the
        # newest adapter version, at most), what switches them, and when the others run once
        self.shelf: dict[str, DrafterEvidence] = {}
        self.switch: WeightsSwitch | None = None
        self.weights_choice = WeightsChoice()
        self._requests = 0  # requests that drafted with the running weights (DrafterEvidence.requests)

    def __deepcopy__(self, memo: dict) -> CostPolicy:
        """A copy of the costs and the evidence that shares the weights switch: the switch drives the
        drafter's weights, which a copy of what was learnt does not own (and a native or llama.cpp
        drafter's weights cannot be copied). The demo decides its timing reruns on such a copy."""
        twin = copy.copy(self)
        memo[id(self)] = twin
        for name, value in vars(self).items():
            if name != "switch":
                setattr(twin, name, copy.deepcopy(value, memo))
        return twin

    @property
    def measured(self) -> bool:
        return self.verify_costs is not None

    @property
    def needs_measuring(self) -> bool:
        return self.verify_costs is None or self._stale_d

    @property
    def stats(self) -> AcceptanceStats:
        """The model drafter's per-position acceptance."""
        return self.acceptance[DRAFTER]

    def acceptance_for(self, key: str, prior: Prior = EVEN_PRIOR) -> AcceptanceStats:
        """A source key's statistics; one seen for the first time starts from ``prior``."""
        if key not in self.acceptance:
            self.acceptance[key] = AcceptanceStats(self.k_max, prior_mean=prior.mean, prior_strength=prior.strength,
                                                   decay=LOOKUP_DECAY)
        return self.acceptance[key]

    # ---- measure

    @torch.inference_mode()
    def measure(self, verifier: Verifier, drafter: Drafter | None, bridge: VocabBridge | None,
                prompt_ids: Sequence[int]) -> float:
        """Time V(k) for k in MEASURE_KS and d on this prompt; returns the seconds it took, which the
        request's tok/s leaves out. The engines are reset after it, so the request still reads its
        whole prompt. ``verifier``: the decoder's (a local engine, or a remote target whose round
        trip is part of V).

        V kept from an earlier process is not timed again, but d is: it is learnt only from drafts,
        so a d that came out too high (a drafter slowed by a trainer sharing the cores) would keep
        the drafter from drafting, and from correcting it, in every later process."""
        t0 = time.perf_counter()
        if self.verify_costs is None:
            self.verify_costs = VerifyCosts(self._time_verifies(verifier, prompt_ids))
            verifier.reset()
        if drafter is not None:  # lookup drafting alone: nothing else to time
            d, read = self._time_drafter(drafter, DrafterContext(bridge, prompt_ids).ids)
            self.draft_cost, self.read_cost = DraftCost(d, alpha=0.1), DraftCost(read, alpha=0.1)
            self._timed = (d, read)
            drafter.reset()
        self._stale_d = False
        return time.perf_counter() - t0

    @staticmethod
    def _time_verifies(verifier: Verifier, prompt_ids: Sequence[int]) -> dict[int, float]:
        ctx = list(prompt_ids[:MEASURE_CONTEXT])
        filler = (list(prompt_ids) * (max(MEASURE_KS) // max(len(prompt_ids), 1) + 2))[: max(MEASURE_KS) + 1]
        greedy = DecodeConfig(verify="greedy")
        verifier.verify(ctx, None, greedy, None)  # prefill
        table: dict[int, list[float]] = {k: [] for k in MEASURE_KS}
        for _ in range(2):
            for k in MEASURE_KS:
                t0 = time.perf_counter()
                verifier.verify(ctx, Proposal(filler[:k]) if k else None, greedy, None)
                table[k].append(time.perf_counter() - t0)
        return {k: min(v) for k, v in table.items()}

    @staticmethod
    def _time_drafter(drafter: Drafter, drafter_ids: Sequence[int]) -> tuple[float, float]:
        """(seconds per drafted token, seconds per token of a read of the context). The read is what
        a drafter that sat out steps pays to catch up: without it a fresh policy would take the
        first catch-up as free and explore where reading the prompt costs more than a draft saves."""
        d_ctx = list(drafter_ids[:MEASURE_CONTEXT]) or [0]
        drafter.lm.logits_for(d_ctx)  # warm: the first read after a pause runs cold
        drafter.reset()
        t0 = time.perf_counter()
        drafter.lm.logits_for(d_ctx)
        read = (time.perf_counter() - t0) / len(d_ctx)
        token = d_ctx[-1]
        times = []
        for i in range(8):  # the first steps after a pause run cold: they are not what drafting costs
            t0 = time.perf_counter()
            drafter.lm.step(token)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        drafter.lm.logits_for(d_ctx)  # leave the drafter's cache on real text
        return statistics.median(times), read

    # ---- persist (what a later run starts from; the loop keeps updating it)

    def state(self) -> dict:
        lookups = {key: st for key, st in self.acceptance.items() if key != DRAFTER}
        # the running weights' evidence (stats, calibration, draft_s, read_s, requests) at the top level
        return {"format": STATE_FORMAT, **self._evidence().state(),
                "verify_s": {str(k): v for k, v in (self.verify_costs.table.items() if self.verify_costs else [])},
                "lookup": {key: {"tried": st.tried, "accepted": st.accepted, "prior": [st.prior_mean, st.prior_strength]}
                           for key, st in lookups.items()},
                "weights": self.weights, "machine": self.machine,
                "shelf": {key: ev.state() for key, ev in self.shelf.items()},
                "weights_choice": self.weights_choice.state(),
                "weights_trials": self.weights_choice.trials_state(),
                "lookup_budget": self.explorations[True].state(), "drafter_budget": self.explorations[False].state(),
                "deepening_budget": self.deepening.state()}

    def restore(self, state: dict) -> bool:
        """Take a saved state; False (and nothing changed) for anything malformed. The running weights'
        evidence is read as the shelf's is (``DrafterEvidence.from_state``), and it must carry a d."""
        try:
            verify = VerifyCosts({int(k): float(v) for k, v in state["verify_s"].items()})
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        running = DrafterEvidence.from_state(state, self._evidence())
        if state.get("format") != STATE_FORMAT or running is None or not running.draft_cost.known:
            return False
        same_machine = state.get("machine") == self.machine
        if same_machine:
            self.verify_costs = verify
            self._stale_d = True
        else:  # costs from other hardware or kernels: measured again
            running.draft_cost, running.read_cost = self.draft_cost, self.read_cost
        self.acceptance.update(self._restore_lookup(state.get("lookup")))
        weights = state.get("weights")
        self.weights = weights if isinstance(weights, str) else None
        self._take(running)
        self.shelf = self._restore_shelf(state.get("shelf"), same_machine)
        self.weights_choice.restore(state.get("weights_choice"))
        self.weights_choice.restore_trials(state.get("weights_trials"))
        self.explorations[True].restore(state.get("lookup_budget"))
        self.explorations[False].restore(state.get("drafter_budget"))
        self.deepening.restore(state.get("deepening_budget"))
        return True

    def drafter_weights(self, key: str) -> None:
        """The drafter now runs the weights ``key`` names (an adapter version, or BASE_WEIGHTS).

        Weights drafted with before in this home (the base weights, or the adapter the weights choice
        switched away from) bring back their own evidence. Other weights (a trainer's new version)
        start from a share of the evidence about the weights before them, so the next outcomes
        dominate, and the drafter explores soon, so one that training made worth drafting is noticed
        within a few steps rather than after up to EXPLORE_MAX. The shelf keeps the base weights and
        the newest adapter: an adapter version the trainer has replaced never runs again."""
        if key == self.weights:
            return
        old, self.weights = self.weights, key
        live = self._evidence()
        if old is not None and (old == BASE_WEIGHTS or key == BASE_WEIGHTS):
            self.shelf[old] = live
        if key != BASE_WEIGHTS:  # one adapter at a time: an older version is dropped
            self.shelf = {k: v for k, v in self.shelf.items() if k in (BASE_WEIGHTS, key)}
        kept = self.shelf.pop(key, None)
        if kept is None:
            kept = live.inherited(KEEP_ON_NEW_WEIGHTS)
            self.explorations[False].restart()
            self.deepening.restart()
        self._take(kept)

    def _evidence(self) -> DrafterEvidence:
        """The running weights' evidence (the live objects, not copies)."""
        return DrafterEvidence(self.stats, self.calibration, self.draft_cost, self.read_cost, self._timed,
                               self._requests)

    def _take(self, evidence: DrafterEvidence) -> None:
        self.acceptance[DRAFTER], self.calibration = evidence.stats, evidence.calibration
        self.draft_cost, self.read_cost = evidence.draft_cost, evidence.read_cost
        self._timed, self._requests = evidence.timed, evidence.requests

    def weights_value(self, key: str) -> float | None:
        """The expected gain of drafting with weights ``key`` over a plain step: tokens/s at the best
        draft length over a plain step's (eq. (5) with that weights' acceptance and d); None where
        these weights have not drafted a request here yet."""
        evidence = self._evidence() if key == self.weights else self.shelf.get(key)
        if evidence is None or evidence.requests == 0 or not self.measured or not evidence.draft_cost.known:
            return None
        k_max = self.k_max
        rates = expected_rates(evidence.stats.rates(k_max), evidence.draft_cost.seconds_per_token,
                               self._capped_verify(), k_max)
        return max(rates) / rates[0]

    def prepare(self) -> None:
        """A request starts: where a switch holds an adapter, pick the weights the request drafts with
        (:class:`WeightsChoice`); count the request for them. After the observers' ``on_start`` (the
        switch has taken the trainer's newest version there) and before the sources begin: the
        drafter's plan holds the weights' acceptance head."""
        adapter = self.switch.adapter_weights if self.switch is not None else None
        if adapter is not None and self.measured:
            keys = (adapter, BASE_WEIGHTS)
            self.switch.run(self.weights_choice.pick({k: self.weights_value(k) for k in keys}, adapter,
                                                     alternates=getattr(self.switch, "alternates", False)))
        else:
            self.weights_choice.pairing = False
        self._requests += 1

    def _pair(self, step: StepResult) -> None:
        """In a paired trial: the model drafter's step counts for the weights that drafted it (its
        drafting, not its catch-up read, and its verify), and the other weights draft next."""
        trials, adapter = self.weights_choice.trials, self.switch.adapter_weights
        if trials is None or trials.adapter != adapter:
            return
        trials.add(self.weights, step.kept + 1, step.draft_s - step.times.catch_up_s + step.verify_s)
        self.switch.run(BASE_WEIGHTS if self.weights == adapter else adapter)

    def _restore_shelf(self, saved: object, same_machine: bool) -> dict[str, DrafterEvidence]:
        """The shelved weights' evidence of a saved state; what is malformed is left out, and costs
        measured on another machine are dropped (observed again while drafting)."""
        out: dict[str, DrafterEvidence] = {}
        for key, entry in (saved.items() if isinstance(saved, dict) else ()):
            evidence = DrafterEvidence.from_state(entry, self._evidence()) if isinstance(key, str) else None
            if evidence is not None and key != self.weights:
                if not same_machine:
                    evidence.draft_cost, evidence.read_cost = DraftCost(alpha=0.1), DraftCost(alpha=0.1)
                out[key] = evidence
        return out

    def _restore_lookup(self, saved: object) -> dict[str, AcceptanceStats]:
        """The per-source lookup statistics of a saved state; what is malformed is left out."""
        out: dict[str, AcceptanceStats] = {}
        for key, counts in (saved.items() if isinstance(saved, dict) else ()):
            try:
                tried, accepted = [float(x) for x in counts["tried"]], [float(x) for x in counts["accepted"]]
                prior = Prior(*(float(x) for x in counts.get("prior", EVEN_PRIOR)))
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
            if isinstance(key, str) and key != DRAFTER and len(tried) == len(accepted) == self.k_max and all(
                    0 <= a <= t for a, t in zip(accepted, tried)) and 0.0 < prior.mean < 1.0 and prior.strength > 0:
                stats = self.acceptance_for(key, prior)
                stats.tried, stats.accepted = tried, accepted
                out[key] = stats
        return out

    def keep_at(self, path: Path, machine: str = "") -> None:
        """Start from the state kept at ``path`` (a missing or malformed file: measure again) and
        keep it there after each request. ``machine`` names what costs depend on beyond the pair and
        engine (the CPU, the native kernels): a state measured on another keeps only its acceptance
        statistics, and the costs are measured again."""
        self.path, self.machine = path, machine
        try:
            self.restore(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            pass

    def save(self) -> None:
        """Write the state to ``path`` (once measured); a read-only home is one line, never an error."""
        if self.path is None or not self.measured:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path, self.state(), indent=None)
        except (OSError, OmnidraftError) as exc:  # a read-only home: measure again next time
            warn(f"could not keep the draft policy's measurements in {self.path}: {exc}")

    def cost_table_ms(self) -> dict[int, float]:
        return {k: round(v * 1000, 2) for k, v in (self.verify_costs.table.items() if self.verify_costs else [])}

    # ---- decide

    def order(self, sources: Sequence[DraftSource]) -> list[DraftSource]:
        return free_first(sources)

    def choose(self, offers: Sequence[tuple[Offer, bool]]) -> tuple[int, int]:
        """Which of this step's offers drafts, and how many tokens: (its index, k), or (-1, 0) for a
        plain step. ``offers``: each source's :class:`Offer` and whether the source is free.

        Of the offers expected to beat a plain step, the one expected to emit the most tokens per
        second drafts (ties: the earlier, so a free source before the drafter). Taking the first
        that pays instead would let a one-token lookup preempt a drafter expected to emit several,
        and leave the drafter behind the text, which keeps it off longer. When none pays, the
        first whose exploration is due explores."""
        plans = [self._plan(offer, free) for offer, free in offers]
        chosen, k = self._pick(offers, plans)
        for i, (offer, free) in enumerate(offers):
            if not free:  # what the policy did with the drafter (bench reports it)
                allowed = k if i == chosen else 0
                self.choices[allowed] = self.choices.get(allowed, 0) + 1
        # the drafter (token by token) may draft all of its limit: its stop rule (:meth:`stop_rule`)
        # ends the draft where one more token stops paying
        return chosen, (k if chosen < 0 or offers[chosen][1] else offers[chosen][0].limit)

    def _pick(self, offers: Sequence[tuple[Offer, bool]],
              plans: Sequence[tuple[int, float, Callable[[float], int]]]) -> tuple[int, int]:
        paying = [i for i, (k, _, _) in enumerate(plans) if k]
        if paying:
            best = max(paying, key=lambda i: plans[i][1])  # max keeps the first of equals
            for (_, free), (k, _, _) in zip(offers, plans):
                self.explorations[free].tally(k)
            return best, plans[best][0]
        for i, ((_, free), (_, _, explore_k)) in enumerate(zip(offers, plans)):
            k = self.explorations[free].choose(0, explore_k)
            if k:
                return i, k
        return -1, 0

    def allow(self, key: str, free: bool, k_max: int, unread: int = 0, prior: Prior = EVEN_PRIOR, room: int = 0) -> int:
        """How many tokens source ``key`` may draft this step when it is the only one on offer (0:
        none); ``choose`` with one offer."""
        from omnidraft.sources.base import Offer  # the sources import this module

        return self.choose([(Offer(key, k_max, unread=unread, prior=prior, room=room), free)])[1]

    def _plan(self, offer: Offer, free: bool) -> tuple[int, float, Callable[[float], int]]:
        """An offer's best length k (0: it does not pay), the tokens per second expected at k, and
        the length an exploration would draft within a budget. A source that drafts token by token
        (not free) and sat out steps reads its unread tokens first; that read is charged to every
        token the request can still emit, up to CATCH_UP_HORIZON (:meth:`catch_up_per_token`).
        Charging all of it to one draft (or to the next few) kept a drafter that pays from catching
        up on a long prompt; charging none would wake a long-idle drafter near the end of a request,
        where the read cannot pay back."""
        d = 0.0 if free else self.draft_cost.seconds_per_token
        costs = self._capped_verify()
        catch_up = 0.0 if free else self.catch_up_per_token(offer.unread, offer.room)
        read = 0.0 if free else offer.unread * self.read_cost.seconds_per_token
        k_max = offer.limit
        rates = with_catch_up(expected_rates(self.acceptance_for(offer.key, offer.prior).rates(k_max), d, costs, k_max),
                              catch_up)
        k = best_rate(rates, DRAFT_MIN_GAIN)
        return k, rates[k], lambda room: explore_length(d, costs, k_max, room, catch_up, read)

    def may_draft_first(self, offer: Offer, free: bool) -> bool:
        """Whether ``offer`` may draft the step that reads a request's new text. A free source may. The
        drafter would first read all the text it has not read, and the first token would wait for that
        read, the draft and the longer verify: where the read alone takes longer than FIRST_READ_SHARE
        of a plain step (a new prompt: tens to hundreds of ms), the first token is left to the target,
        which emits it at its own latency, and the drafter reads the text at the next step, as a
        catch-up. The request gives up the proposals that would have ridden along the prompt read,
        about one plain step's worth (docs/performance.md). A chat turn whose history the drafter read
        while the user typed (``chat/session.py``) reads only the new message, and a short one drafts
        at once."""
        if free or not self.measured or not self.read_cost.known:
            return True
        return offer.unread * self.read_cost.seconds_per_token <= FIRST_READ_SHARE * self._capped_verify()(0)

    def catch_up_per_token(self, unread: int, room: int = 0) -> float:
        """Seconds each emitted token pays for reading ``unread`` tokens first: the read spread over
        the ``room`` tokens the request may still emit (0: unknown), at most CATCH_UP_HORIZON."""
        if unread <= 0:
            return 0.0
        span = min(room, CATCH_UP_HORIZON) if room > 0 else CATCH_UP_HORIZON
        return unread * self.read_cost.seconds_per_token / span

    def stop_rule(self, k_max: int, head: AcceptHead | None) -> StopRule:
        self._stop = CostAwareStop(self, k_max, head)
        return self._stop

    def sequence(self, k_max: int) -> SequentialDraft:
        return SequentialDraft(self.draft_cost.seconds_per_token, self._capped_verify(), k_max)

    def deepen(self, drafted: int) -> bool:
        """Whether a draft its stop rule ends after ``drafted`` tokens drafts one more, to explore the
        next position (:attr:`deepening`): when the schedule is due and its budget affords the token
        being rejected (d and the verify row it adds, in plain steps)."""
        cost = self._one_more_token(drafted + 1)
        return self.deepening.choose(0, lambda room: int(cost <= room)) > 0

    def _settle_deepening(self, step: StepResult, at: int) -> None:
        """An exploration of drafter position ``at`` (:meth:`deepen`): it lost the token's cost in plain
        steps and won one token where the target kept it; a draft that ended before it settles nothing."""
        if step.drafted < at:
            self.deepening.cancel()
            return
        self.deepening.settle(self._one_more_token(step.proposed) - int(step.kept >= at))

    def _one_more_token(self, k: int) -> float:
        """Plain steps' worth of time one more drafted token costs where it makes the k-th verified
        row: d and what that row adds to the verify."""
        V = self._capped_verify()
        return (self.draft_cost.seconds_per_token + max(V(k) - V(max(k - 1, 0)), 0.0)) / V(0)

    def _capped_verify(self) -> Callable[[int], float]:
        """V, with V(0) never above V(1): a policy that drafts observes no plain step, so a V(0) once
        inflated (a slow moment) would otherwise keep it drafting at a loss."""
        v0_cap = self.verify_costs(1)
        return lambda k: min(self.verify_costs(0), v0_cap) if k == 0 else self.verify_costs(k)

    def may_branch(self, cap: int) -> bool:
        return cap != 0

    def branch_rows(self, proposed: int, cap: int) -> int:
        """How many branch rows to verify beside a chain of ``proposed``. The translator hangs them
        from the first positions on, and a branch at depth j pays when the chain is first rejected
        there (P = a_1 ... a_j (1 - a_{j+1})) and the target wants the branch's token (``branch_hits``):
        rows are added while that expected token, at the current time per emitted token
        (k d + V(k)) / E(k), is worth more than the verify time the row adds (V's slope there)."""
        if cap == 0 or not self.measured or proposed < 1:
            return 0
        limit = MAX_BRANCH_ROWS if cap < 0 else cap
        V, d = self._capped_verify(), self.draft_cost.seconds_per_token
        rates = self.stats.rates(proposed)
        per_token = (proposed * d + V(proposed)) / self.stats.expected_tokens(proposed)
        hit, reach, rows = self.branch_hits.rate(1), 1.0, 0
        for a in rates:
            worth = hit * reach * (1 - a) * per_token
            if rows >= limit or V(proposed + rows + 1) - V(proposed + rows) > worth:
                break
            rows, reach = rows + 1, reach * a
        return rows

    # ---- learn

    def learn(self, step: StepResult, reads_prompt: bool) -> None:
        """Fold one verified step in. ``reads_prompt``: the verify also read the prompt, so its time
        says nothing about V."""
        if step.free or step.source is None:  # the drafter sat out this step
            self.draft_cost.relax(self._timed[0], STALE_COST_KEEP)
            self.read_cost.relax(self._timed[1], STALE_COST_KEEP)
        if step.source is None:  # a plain step
            if not reads_prompt:
                self.verify_costs.observe(0, step.verify_s)
            return
        if not step.free:
            self._observe_draft_cost(step)
            if step.times.catch_up_tokens >= READ_SAMPLE_MIN:
                self.read_cost.observe(step.times.catch_up_tokens, step.times.catch_up_s)
        if step.proposal is not None and step.proposal.branches:
            end = step.accepted - step.branch_kept  # where the chain stopped
            if any(b.depth == end for b in step.proposal.branches):
                self.branch_hits.update(1, int(step.branch_kept > 0))
        if not reads_prompt:
            self.verify_costs.observe(step.proposed + step.branch_rows, step.verify_s)  # V counts rows
            # an exploration is charged its whole catch-up read, as explore_length priced its worst
            # case: if it lost, the drafter sits out again and that read paid for nothing
            plain = self._capped_verify()(0)
            self.explorations[step.free].settle((step.draft_s + step.verify_s) / plain - (step.kept + 1))
        self.acceptance_for(step.key).update(step.drafted, step.kept)
        if not step.free and self._stop is not None and self._stop.deepened:
            self._settle_deepening(step, self._stop.deepened)
            self._stop.deepened = 0
        probs = self._stop.probs if self._stop is not None and not step.free else []
        for i, q in enumerate(probs[: step.kept + 1]):  # conditional on the ones before being kept
            self.calibration.update(q, i < step.kept)
        if self.weights_choice.pairing and not step.free and not reads_prompt and self.switch is not None:
            self._pair(step)


    def _observe_draft_cost(self, step: StepResult) -> None:
        """d is the cost of a drafted token while the drafter keeps up with the text. A draft that
        first caught up on skipped text (after plain or lookup steps) would inflate it by that read,
        and an inflated d declines drafts, which makes the next catch-up longer: its tokens after
        the first count alone (the first came out of the read)."""
        caught_up = step.times.catch_up_s
        if caught_up <= 0:
            self.draft_cost.observe(step.drafted, step.draft_s)
        elif step.drafted > 1:
            self.draft_cost.observe(step.drafted - 1, step.draft_s - caught_up)


class CostAwareStop:
    """Stop rule of the cost-aware policy: continue while one more token is expected to pay."""

    def __init__(self, policy: CostPolicy, k_max: int, head: AcceptHead | None = None) -> None:
        self.policy, self.k_max, self.head = policy, k_max, head
        # the head of the weights drafting now, where a request may switch weights between drafts (a
        # paired trial): set by the drafter source when the request uses heads; else ``head`` throughout
        self.head_of: Callable[[], AcceptHead | None] | None = None
        self.probs: list[float] = []  # q(token) of each drafted token, for the calibration
        self.deepened = 0  # the drafter position this draft explores past its stop (0: none; CostPolicy.deepen)

    def start(self) -> None:
        self.probs = []
        self._seq = self.policy.sequence(self.k_max)
        self.deepened = 0

    def stop_after(self, token, masked, q, hidden, logits) -> bool:
        prob = float(q[token]) if q is not None else float(torch.softmax(masked, -1)[token])
        self.probs.append(prob)
        head = self.head_of() if self.head_of is not None else self.head
        estimate = head.accept_prob(hidden, logits) if head is not None else self.policy.calibration(prob)
        self._seq.push(min(max(estimate, 0.0), 1.0))
        if self._seq.should_continue(a_next=self.policy.stats.rate(self._seq.i + 1)):
            return False
        if not self.deepened and self._seq.i < self.k_max and self.policy.deepen(self._seq.i):
            self.deepened = self._seq.i + 1
            return False
        return True

