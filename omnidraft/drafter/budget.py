"""The cost-aware draft policy: draft only as long as it is expected to raise tokens per second.

Speculation pays when the target verifies k tokens for about the price of one (a memory-bound
fp32/bf16 target, a GPU, a network round trip) and loses on a compute-bound CPU engine such as
llama.cpp, where an eval of k tokens costs ~k/1.6 steps. :class:`DraftBudget` keeps the numbers
that decide it, measured at the first request and then followed online (``omnidraft.costs``):

- V(m): the target's seconds for a verify with m proposals (V(0) is a plain step);
- d: the drafter's seconds per drafted token;
- a_i: how often the i-th drafted token survives verification given the ones before it did
  (per-position counts), and a calibration of the drafter's own confidence q(token) into such a
  probability (counted per confidence bin), or the acceptance head's estimate when the adapter
  has one (OmniDraft §3.3).

Each step: if no draft length k > 0 is expected to beat a plain step (E(k)/T(k) > 1/V(0), see
``costs.best_draft_length``), the step is a plain target step — never drafting at a loss. Else
the drafter drafts token by token, and after each token the policy asks ``costs.should_continue``
with that token's own acceptance estimate. A step that skipped drafting occasionally drafts
anyway (when drafting could pay at all), so the statistics follow a drafter or text that changes;
each exploration that loses time makes the next one twice as rare (every 16 skipped steps at
first, at most every 256), so a pair where drafting never pays costs almost nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from types import SimpleNamespace

import torch

from omnidraft.adapter.head import AcceptHead
from omnidraft.costs import (
    AcceptanceStats,
    DraftCost,
    SequentialDraft,
    VerifyCosts,
    best_draft_length,
)

MEASURE_KS = (0, 1, 2, 3, 4, 6, 8)  # proposals per measured verify (k + 1 new tokens)
MEASURE_CONTEXT = 128  # context tokens behind the measured evals
EXPLORE_EVERY = 16  # a skipped step drafts anyway this often, when drafting could pay at all
EXPLORE_MAX = 256  # ... and, after explorations that lost time, up to this rarely (doubling each time)
OPTIMISTIC_ACCEPTANCE = 0.9  # "could pay at all": the best case a real drafter reaches


class ConfidenceCalibration:
    """P(a drafted token is accepted | the drafter's probability q of it), counted in bins of q.

    Each bin starts as a Beta prior centred on q itself (a drafter that is calibrated needs no
    correction) and follows the verified outcomes of its tokens.
    """

    def __init__(self, bins: int = 10, prior_strength: float = 4.0) -> None:
        self.bins = bins
        self.accepted = [(b + 0.5) / bins * prior_strength for b in range(bins)]
        self.tried = [prior_strength] * bins

    def _bin(self, q: float) -> int:
        return min(int(q * self.bins), self.bins - 1)

    def __call__(self, q: float) -> float:
        b = self._bin(q)
        return self.accepted[b] / self.tried[b]

    def update(self, q: float, accepted: bool) -> None:
        b = self._bin(q)
        self.tried[b] += 1
        self.accepted[b] += float(accepted)


class DraftBudget:
    """The measured costs and acceptance statistics of one drafter–target pair on this machine."""

    def __init__(self, k_max: int = 16) -> None:
        self.verify: VerifyCosts | None = None
        self.draft = DraftCost(alpha=0.1)
        self.stats = AcceptanceStats(k_max, prior_mean=0.6, decay=0.995)
        self.k_max = k_max
        self.lookup_stats: dict[str, AcceptanceStats] = {}  # per lookup source ("context-4", "history-3", …)
        self.lookup_explore_every = EXPLORE_EVERY
        self._lookup_since = 0
        self._lookup_exploring = False
        self.calibration = ConfidenceCalibration()
        self.skipped = 0
        self.explore_every = EXPLORE_EVERY
        self._since_explored = 0
        self._exploring = False
        self.choices: dict[int, int] = {}  # draft budget chosen -> steps (what the policy did)

    @property
    def measured(self) -> bool:
        return self.verify is not None

    # ---- start-up measurement

    @torch.inference_mode()
    def measure(self, verifier, drafter, prompt_ids: Sequence[int], drafter_ids: Sequence[int]) -> None:
        """V(k) for k in MEASURE_KS and d, timed on this prompt (its KV entries are then reused).

        ``verifier``: the decoder's (a local engine or a remote target: a round trip is part of V)."""
        ctx = list(prompt_ids[:MEASURE_CONTEXT])
        filler = (list(prompt_ids) * (max(MEASURE_KS) // max(len(prompt_ids), 1) + 2))[: max(MEASURE_KS) + 1]
        greedy = SimpleNamespace(verify="greedy", temperature=0.0, top_p=1.0, seed=0)
        verifier.verify(ctx, None, greedy, None)  # prefill
        table: dict[int, list[float]] = {k: [] for k in MEASURE_KS}
        for _ in range(2):
            for k in MEASURE_KS:
                t0 = time.perf_counter()
                verifier.verify(ctx, SimpleNamespace(proposed=filler[: k]) if k else None, greedy, None)
                table[k].append(time.perf_counter() - t0)
        self.verify = VerifyCosts({k: min(v) for k, v in table.items()})
        if drafter is None:  # lookup drafting alone: nothing else to time
            return
        d_ctx = list(drafter_ids[:MEASURE_CONTEXT]) or [0]
        drafter.lm.logits_for(d_ctx)
        token = d_ctx[-1]
        times = []
        for i in range(8):  # the first steps after a pause run cold: they are not what drafting costs
            t0 = time.perf_counter()
            drafter.lm.step(token)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        self.draft = DraftCost(statistics.median(times), alpha=0.1)
        drafter.lm.logits_for(d_ctx)  # leave the drafter's cache on real text

    # ---- kept across processes (what a later run starts from; the loop keeps updating it)

    def state(self) -> dict:
        return {"format": 2, "verify_s": {str(k): v for k, v in (self.verify.table.items() if self.verify else [])},
                "draft_s": self.draft.seconds_per_token if self.draft.known else None,
                "stats": {"tried": self.stats.tried, "accepted": self.stats.accepted},
                "lookup": {key: {"tried": st.tried, "accepted": st.accepted} for key, st in self.lookup_stats.items()},
                "calibration": {"tried": self.calibration.tried, "accepted": self.calibration.accepted}}

    def restore(self, state: dict) -> bool:
        """Take a saved state; False (and nothing changed) for anything malformed."""
        try:
            verify = VerifyCosts({int(k): float(v) for k, v in state["verify_s"].items()})
            draft = float(state["draft_s"])
            tried, accepted = [float(x) for x in state["stats"]["tried"]], [float(x) for x in state["stats"]["accepted"]]
            c_tried = [float(x) for x in state["calibration"]["tried"]]
            c_accepted = [float(x) for x in state["calibration"]["accepted"]]
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        ok = (state.get("format") == 2 and len(tried) == len(accepted) == self.stats.max_positions
              and len(c_tried) == len(c_accepted) == self.calibration.bins and draft > 0
              and all(0 <= a <= t for a, t in zip(accepted + c_accepted, tried + c_tried)))
        lookup = self._restore_lookup(state.get("lookup"))
        if ok:
            self.lookup_stats.update(lookup)
            self.verify, self.draft = verify, DraftCost(draft, alpha=0.1)
            self.stats.tried, self.stats.accepted = tried, accepted
            self.calibration.tried, self.calibration.accepted = c_tried, c_accepted
        return ok

    def _restore_lookup(self, saved) -> dict[str, AcceptanceStats]:
        """The per-source lookup statistics of a saved state; what is malformed is left out."""
        out: dict[str, AcceptanceStats] = {}
        for key, counts in (saved.items() if isinstance(saved, dict) else ()):
            try:
                tried, accepted = [float(x) for x in counts["tried"]], [float(x) for x in counts["accepted"]]
            except (KeyError, TypeError, ValueError):
                continue
            if isinstance(key, str) and len(tried) == len(accepted) == self.k_max and all(
                    0 <= a <= t for a, t in zip(accepted, tried)):
                stats = self.lookup_for(key)
                stats.tried, stats.accepted = tried, accepted
                out[key] = stats
        return out

    def cost_table_ms(self) -> dict[int, float]:
        return {k: round(v * 1000, 2) for k, v in (self.verify.table.items() if self.verify else [])}

    # ---- the decisions

    def plan(self, k_max: int) -> int:
        """How many tokens this step may draft at most; 0 = a plain target step."""
        d, verify = self.draft.seconds_per_token, self._verify_costs()
        k = best_draft_length(self.stats.rates(k_max), d, verify, k_max)
        self._exploring = False
        if k == 0:
            self.skipped += 1
            self._since_explored += 1
            if self._since_explored >= self.explore_every and best_draft_length(OPTIMISTIC_ACCEPTANCE, d, verify, k_max):
                k = k_max  # explore: the statistics must see drafts to notice that they could pay
                self._exploring, self._since_explored = True, 0
        self.choices[k] = self.choices.get(k, 0) + 1
        return k and k_max

    def lookup_for(self, source: str) -> AcceptanceStats:
        if source not in self.lookup_stats:
            self.lookup_stats[source] = AcceptanceStats(self.k_max, prior_mean=0.5, decay=0.995)
        return self.lookup_stats[source]

    def plan_lookup(self, k_max: int, source: str = "context") -> int:
        """How many tokens of a lookup draft (free to draft) from ``source`` are expected to pay; 0:
        none. Where the prior says no but a lookup could pay at all (an engine whose verify costs
        grow fast, llama.cpp), a draft is tried now and then so the counts can show it does."""
        verify = self._verify_costs()
        k = best_draft_length(self.lookup_for(source).rates(k_max), 0.0, verify, k_max)
        self._lookup_exploring = False
        if k == 0:
            self._lookup_since += 1
            if self._lookup_since >= self.lookup_explore_every and best_draft_length(OPTIMISTIC_ACCEPTANCE, 0.0, verify, k_max):
                k, self._lookup_since, self._lookup_exploring = k_max, 0, True
        return k

    def observe_lookup(self, source: str, proposed: int, accepted: int, verify_s: float | None) -> None:
        """A verified lookup draft (``verify_s`` None: the verify also read the prompt)."""
        self.lookup_for(source).update(proposed, accepted)
        if verify_s is None:
            return
        self.verify.observe(proposed, verify_s)
        if self._lookup_exploring:
            paid = (accepted + 1) * self._verify_costs()(0) >= verify_s
            self.lookup_explore_every = EXPLORE_EVERY if paid else min(2 * self.lookup_explore_every, EXPLORE_MAX)
            self._lookup_exploring = False

    def sequence(self, k_max: int) -> SequentialDraft:
        return SequentialDraft(self.draft.seconds_per_token, self._verify_costs(), k_max)

    def _verify_costs(self):
        """V, with V(0) never above V(1): a policy that drafts observes no plain step, so a V(0) once
        inflated (a slow moment) would otherwise keep it drafting at a loss."""
        v0_cap = self.verify(1)
        return lambda k: min(self.verify(0), v0_cap) if k == 0 else self.verify(k)

    # ---- what the loop observed

    def observe_plain(self, seconds: float) -> None:
        self.verify.observe(0, seconds)

    def observe_step(self, drafted: int, draft_s: float, proposed: int, verify_s: float | None, kept: int,
                     token_probs: Sequence[float]) -> None:
        """One speculative step: ``kept`` of the ``drafted`` tokens survived verification.
        ``verify_s`` is None when the verify also read the prompt (the first step of a request)."""
        self.draft.observe(drafted, draft_s)
        if verify_s is not None:
            self.verify.observe(proposed, verify_s)
            if self._exploring:  # a losing exploration makes the next one twice as rare; a paying one resets
                paid = (kept + 1) * self._verify_costs()(0) >= draft_s + verify_s
                self.explore_every = EXPLORE_EVERY if paid else min(2 * self.explore_every, EXPLORE_MAX)
                self._exploring = False
        self.stats.update(drafted, kept)
        for i, q in enumerate(token_probs[: kept + 1]):  # conditional on the ones before being kept
            self.calibration.update(q, i < kept)


class CostAwareStop:
    """Stop rule of the cost-aware policy: continue while one more token is expected to pay."""

    def __init__(self, budget: DraftBudget, k_max: int, head: AcceptHead | None = None) -> None:
        self.budget, self.k_max, self.head = budget, k_max, head
        self.probs: list[float] = []  # q(token) of each drafted token, for the calibration

    def start(self) -> None:
        self.probs = []
        self._seq = self.budget.sequence(self.k_max)

    def stop_after(self, token, masked, q, hidden, logits) -> bool:
        prob = float(q[token]) if q is not None else float(torch.softmax(masked, -1)[token])
        self.probs.append(prob)
        estimate = self.head.accept_prob(hidden, logits) if self.head is not None else self.budget.calibration(prob)
        self._seq.push(min(max(estimate, 0.0), 1.0))
        return not self._seq.should_continue(a_next=self.budget.stats.rate(self._seq.i + 1))

