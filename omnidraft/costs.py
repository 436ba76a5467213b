"""How many tokens to draft: a cost model that speculates only when tokens/second go up.

One speculative step drafts k tokens (k drafter forwards) and verifies them in one target eval of
k + 1 new tokens. With conditional acceptance probabilities a_1..a_k (a_i = P(the i-th proposal
is accepted | proposals 1..i-1 were)), the expected number of tokens the step emits is::

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j        (the "+1" is the target's own token)

and its expected time is::

    T(k) = k*d + V(k)

where d is the drafter's seconds per drafted token and V(k) the measured seconds of a target eval
with k proposals (V(0) is a plain decoding step). Plain decoding (k = 0) gives E(0)/T(0) = 1/V(0)
tokens/s; speculation pays only when some k > 0 has E(k)/T(k) > 1/V(0).

Why V(k) must be measured, not assumed: on a memory-bound target an eval of a few tokens costs
about one step (V(k) ~ V(0): long drafts pay), while compute-bound CPU kernels (llama.cpp) cost
more with every token, and a torch engine's cost is not even monotone in k (docs/performance.md
has measured tables). :class:`VerifyCosts` keeps a measured table, interpolates the rest and
follows the real verify times the loop observes; :class:`DraftCost` and
:class:`AcceptanceStats` track d and a_i online; :func:`best_draft_length` (all at once) and
:func:`should_continue` / :class:`SequentialDraft` (token by token) decide.

Pure Python (no torch): usable from the loop, the CLI and the benchmarks alike.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

CostFn = Callable[[int], float] | Mapping[int, float]
Acceptance = float | Sequence[float]
FIRST_WEIGHT = 0.5  # weight of the first observation of an unmeasured k (see VerifyCosts.observe)
STALL_FACTOR = 1.5  # an observed verify counts as at most this many times the next larger known k's cost


def _check_alpha(alpha: float) -> float:
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"EMA weight must be in (0, 1], got {alpha}")
    return float(alpha)


def _usable(seconds: float) -> bool:
    return isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0


# --------------------------------------------------------------------------------------- costs


class VerifyCosts:
    """V(k): seconds of one target eval with k proposals (k + 1 new tokens; k = 0 is a plain step).

    Built from a measured table ``{k: seconds}``. Unmeasured k are interpolated linearly between
    the nearest known neighbours; beyond the largest known k the last segment's slope continues
    (never below zero), below the smallest the cost scales with the number of new tokens. A
    single known point extrapolates proportionally to new tokens (the compute-bound assumption,
    pessimistic for memory-bound targets until real observations come in).

    ``observe(k, seconds)`` folds a verify time the loop measured into the table with an
    exponential moving average: ``V(k) <- (1 - alpha) * V(k) + alpha * seconds``. The first
    observation of an unmeasured k starts from the interpolated value with weight
    ``max(alpha, FIRST_WEIGHT)`` so a real measurement quickly replaces a guess. Verifying more
    proposals never costs less, so an observation counts as at most ``STALL_FACTOR`` times the cost
    of the next larger k the table knows: a one-off stall (a garbage-collector pass, a kernel timed
    on its first call for a new row count) once made V(5) read 775 ms between V(4) = 111 and
    V(6) = 122, and a policy that then never drafts 5 never observes it again. The largest known k
    has nothing above it: its first observation counts as at most ``STALL_FACTOR`` times the
    extrapolated cost (the same stall once made a new V(9) read 926 ms after V(8) = 137), and the
    later ones as observed (a compute-bound target's costs must be learnt). Points the loop has not
    observed yet follow V(0) in proportion as plain steps observe it (``_follow_plain_step``).

    A table given to the constructor (a fresh timing, or one a home kept) is made monotone first: a
    point above a larger k's is lowered to it (``_no_dearer_than_above``). A stall during the timing,
    or a home whose points were observed while another job shared the cores, left V(1) = 250 ms and
    V(4) = 278 ms between V(2) = 71 and V(5) = 69: a stop rule that never drafts a dear length never
    observes it again.
    """

    def __init__(self, table: Mapping[int, float], *, alpha: float = 0.1) -> None:
        clean = {int(k): float(v) for k, v in table.items() if int(k) >= 0 and _usable(v)}
        if not clean:
            raise ValueError("VerifyCosts needs at least one measured (k >= 0, seconds > 0) entry")
        self.alpha = _check_alpha(alpha)
        self._table: dict[int, float] = _no_dearer_than_above(clean)
        self._keys: list[int] = sorted(clean)
        self.observations: dict[int, int] = {}
        self.guessed: set[int] = set()  # points assumed, not measured (``flat``'s V(1)), until observed

    @classmethod
    def from_eval_ms(cls, eval_ms: Mapping[int, float], **kwargs) -> VerifyCosts:
        """From a table of *new tokens -> milliseconds* (what ``LlamaCppTarget.measure_costs``
        returns): an eval of n new tokens verifies k = n - 1 proposals."""
        return cls({int(n) - 1: ms / 1000.0 for n, ms in eval_ms.items() if int(n) >= 1}, **kwargs)

    @classmethod
    def flat(cls, step_seconds: float, **kwargs) -> VerifyCosts:
        """A memory-bound target: every few-token verify costs one step (until observed otherwise)."""
        costs = cls({0: step_seconds, 1: step_seconds}, **kwargs)
        costs.guessed.add(1)
        return costs

    @property
    def table(self) -> dict[int, float]:
        """The known points (measured and observed), k -> seconds."""
        return dict(sorted(self._table.items()))

    def __call__(self, k: int) -> float:
        if k < 0:
            raise ValueError(f"number of proposals must be >= 0, got {k}")
        table, keys = self._table, self._keys
        if k in table:
            return table[k]
        pos = bisect.bisect_left(keys, k)
        if pos == 0:  # below the smallest known k: proportional to new tokens
            k0 = keys[0]
            return table[k0] * (k + 1) / (k0 + 1)
        if pos == len(keys):  # beyond the largest known k
            hi = keys[-1]
            if len(keys) == 1:
                return table[hi] * (k + 1) / (hi + 1)
            lo = keys[-2]
            slope = max(0.0, (table[hi] - table[lo]) / (hi - lo))
            return table[hi] + slope * (k - hi)
        lo, hi = keys[pos - 1], keys[pos]
        w = (k - lo) / (hi - lo)
        return table[lo] * (1 - w) + table[hi] * w

    def observe(self, k: int, seconds: float) -> None:
        """Fold one observed verify time (k proposals, seconds) into the table (EMA)."""
        if k < 0 or not _usable(seconds):
            return
        new = k not in self._table
        if not new:
            prior, weight = self._table[k], self.alpha
        else:
            prior, weight = self(k), max(self.alpha, FIRST_WEIGHT)
            bisect.insort(self._keys, k)
        above = bisect.bisect_right(self._keys, k)
        if above < len(self._keys):
            seconds = min(seconds, STALL_FACTOR * self._table[self._keys[above]])
        elif new and len(self._keys) > 2 and not self.guessed.intersection(self._keys[-3:-1]):
            seconds = min(seconds, STALL_FACTOR * prior)  # a new largest k, extrapolated from measured points
        self.guessed.discard(k)
        self._table[k] = prior + weight * (seconds - prior)
        self.observations[k] = self.observations.get(k, 0) + 1
        if k == 0 and not new:
            self._follow_plain_step(self._table[0] / prior)

    def _follow_plain_step(self, factor: float) -> None:
        """Scale the points the loop never observed by ``factor``, the change of V(0). A table timed
        while something else had the cores is dear throughout; plain steps then observe V(0) at the
        real speed, but a verify that looks dear is never made, so its V(k) would never be observed
        and drafting stayed off for good (a home keeps the table). The measured shape, V(k) / V(0),
        is what the timing can tell; observed points have their own evidence and keep it."""
        for k in self._keys:
            if k and not self.observations.get(k):
                self._table[k] *= factor


def _no_dearer_than_above(table: Mapping[int, float]) -> dict[int, float]:
    """``table`` with each point lowered to the least of the points at larger k (verifying more
    proposals never costs less; a stall only ever reads dearer)."""
    out, least = {}, math.inf
    for k in sorted(table, reverse=True):
        least = min(least, table[k])
        out[k] = least
    return dict(sorted(out.items()))


OUTLIER = 3.0  # a drafting round counts as at most this many times the current d (DraftCost)


class DraftCost:
    """d: the drafter's seconds per drafted token, an exponential moving average of observations.

    ``observe(tokens, seconds)`` takes one drafting round (``tokens`` drafted in ``seconds``);
    ``d <- (1 - alpha) * d + alpha * min(seconds / tokens, outlier * d)``. Before the first
    observation ``d`` is ``initial`` (None: the first observation is taken as is). The cap keeps one
    round that waited on something else (a read, another process on the cores) from raising d
    several-fold: a d too high stops drafting, and with it the observations that would lower it.
    A drafter that really became slower still moves d up by (outlier - 1) * alpha per round.
    """

    def __init__(self, initial: float | None = None, *, alpha: float = 0.1, outlier: float = OUTLIER) -> None:
        self.alpha = _check_alpha(alpha)
        self.outlier = outlier
        self._d = float(initial) if initial is not None and _usable(initial) else None
        self.observations = 0

    @property
    def seconds_per_token(self) -> float:
        return self._d if self._d is not None else 0.0

    @property
    def known(self) -> bool:
        return self._d is not None

    def __float__(self) -> float:
        return self.seconds_per_token

    def relax(self, toward: float, keep: float) -> None:
        """Move the cost ``1 - keep`` of the way down to ``toward`` (its timing in this process), never
        up. The policy's costs (d, the read cost) are observed only while drafting, so one that rose
        while something else used the cores would otherwise stop drafting for good: as steps without
        drafting pass it returns to the timing, and the next exploration observes it again."""
        if self._d is not None and self._d > toward > 0:
            self._d = toward + keep * (self._d - toward)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not _usable(seconds):
            return
        per = seconds / tokens
        self._d = per if self._d is None else self._d + self.alpha * (min(per, self.outlier * self._d) - self._d)
        self.observations += 1


# --------------------------------------------------------------------------------- acceptance


class Prior(NamedTuple):
    """Where a source's acceptance starts before any evidence: a mean, worth ``strength`` observations."""

    mean: float
    strength: float


EVEN_PRIOR = Prior(0.5, 2.0)  # a source nothing is known about: an even chance, soon outweighed


class AcceptanceStats:
    """Per draft position i = 1..K: how often the i-th proposal was accepted *given that the
    previous ones were* (the conditional rate a_i), with a Beta prior.

    ``a_i = (accepted_i + prior_mean * prior_strength) / (tried_i + prior_strength)``, the
    posterior mean under Beta(prior_mean * s, (1 - prior_mean) * s). After a step that proposed
    p tokens and accepted n of them (the first n), positions 1..n were tried and accepted and
    position n + 1 (if n < p) was tried and rejected; later positions were never reached and are
    not counted. ``decay`` < 1 forgets old steps geometrically (every update multiplies all counts
    by it) so the estimate follows a change of prompt or domain. Positions beyond K share a_K.
    """

    def __init__(self, max_positions: int = 16, *, prior_mean: float = 0.5, prior_strength: float = 2.0,
                 decay: float = 1.0) -> None:
        if max_positions < 1:
            raise ValueError("max_positions must be >= 1")
        if not 0.0 < prior_mean < 1.0 or prior_strength <= 0:
            raise ValueError("prior_mean must be in (0, 1) and prior_strength > 0")
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.max_positions = max_positions
        self.prior_mean = float(prior_mean)
        self.prior_strength = float(prior_strength)
        self.decay = float(decay)
        self.tried = [0.0] * max_positions
        self.accepted = [0.0] * max_positions
        self.steps = 0

    def update(self, proposed: int, accepted: int) -> None:
        """Record one verify step: ``proposed`` tokens drafted, the first ``accepted`` kept."""
        if proposed <= 0:
            return
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted must be in [0, {proposed}], got {accepted}")
        if self.decay < 1.0:
            self.tried = [t * self.decay for t in self.tried]
            self.accepted = [a * self.decay for a in self.accepted]
        last = self.max_positions - 1  # positions past K fold into the last one
        for i in range(accepted):
            j = min(i, last)
            self.tried[j] += 1
            self.accepted[j] += 1
        if accepted < proposed:  # position accepted + 1 was tried and rejected
            self.tried[min(accepted, last)] += 1
        self.steps += 1

    def discount(self, keep: float) -> None:
        """Keep the share ``keep`` of the evidence (the prior's weight is unchanged), so new
        outcomes outweigh those of a drafter that has since changed."""
        self.tried = [t * keep for t in self.tried]
        self.accepted = [a * keep for a in self.accepted]

    def rate(self, i: int) -> float:
        """a_i for the 1-based position i."""
        if i < 1:
            raise ValueError("positions are 1-based")
        j = min(i, self.max_positions) - 1
        s = self.prior_strength
        return (self.accepted[j] + self.prior_mean * s) / (self.tried[j] + s)

    def rates(self, k: int | None = None) -> list[float]:
        """[a_1, ..., a_k] (k defaults to K)."""
        return [self.rate(i) for i in range(1, (self.max_positions if k is None else k) + 1)]

    def expected_tokens(self, k: int) -> float:
        return expected_tokens(self.rates(k), k)


# ----------------------------------------------------------------------------------- decisions


def _rates(a: Acceptance, k: int) -> list[float]:
    """The first k conditional acceptance rates; a float is constant, a short list repeats its last."""
    if isinstance(a, (int, float)):
        vals = [float(a)] * k
    else:
        vals = [float(x) for x in list(a)[:k]]
        if len(vals) < k:
            if not vals:
                raise ValueError("empty acceptance sequence")
            vals += [vals[-1]] * (k - len(vals))
    for x in vals:
        if not 0.0 <= x <= 1.0 or math.isnan(x):
            raise ValueError(f"acceptance probabilities must lie in [0, 1], got {x}")
    return vals


def _cost(V: CostFn) -> Callable[[int], float]:
    if isinstance(V, Mapping):
        return VerifyCosts(V)
    return V


def expected_tokens(a: Acceptance, k: int) -> float:
    """E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j."""
    total, p = 1.0, 1.0
    for x in _rates(a, k):
        p *= x
        total += p
    return total


def expected_rates(a: Acceptance, d: float, V: CostFn, k_max: int) -> list[float]:
    """[E(k) / T(k) for k = 0..k_max] in tokens/second, T(k) = k*d + V(k)."""
    d = float(d)  # a DraftCost works too
    if k_max < 0:
        raise ValueError("k_max must be >= 0")
    if d < 0:
        raise ValueError("costs must be >= 0")
    cost = _cost(V)
    rates = _rates(a, k_max)
    out, e, p = [], 1.0, 1.0
    for k in range(k_max + 1):
        if k:
            p *= rates[k - 1]
            e += p
        t = k * d + cost(k)
        if t <= 0:
            raise ValueError(f"T({k}) must be > 0, got {t}")
        out.append(e / t)
    return out


# A draft expected to beat a plain step by less than this is not made (the policies' choice, on the
# device and on the server): such an estimate rests mostly on a prior (an even chance for a source
# never tried) and on verify costs that vary by a few percent from step to step, and where each
# drafted row costs a good share of a step (a CPU target) a draft whose prior was optimistic loses
# more than the few percent it was expected to win
DRAFT_MIN_GAIN = 1.02


def best_draft_length(a: Acceptance, d: float, V: CostFn, k_max: int, min_gain: float = 1.0) -> int:
    """The k in 0..k_max maximising E(k)/T(k) (expected tokens per second).

    ``a``: the conditional acceptance probabilities a_1..a_k_max (a float for a constant rate; a
    shorter list repeats its last value), e.g. ``AcceptanceStats.rates()``. ``d``: drafter
    seconds per token. ``V``: verify cost, k proposals -> seconds (a :class:`VerifyCosts`, any
    callable, or a mapping that is then interpolated).

    Returns 0 (plain decoding) unless some k > 0 beats E(0)/T(0) = 1/V(0) by ``min_gain``; ties go
    to the smaller k.
    """
    return best_rate(expected_rates(a, d, V, k_max), min_gain)


def best_rate(rates: Sequence[float], min_gain: float = 1.0) -> int:
    """The smallest k whose tokens/s ``rates[k]`` is the largest, if that beats a plain step
    (``rates[0]``) by at least ``min_gain``; else 0."""
    best = 0
    for k in range(1, len(rates)):
        if rates[k] > rates[best]:
            best = k
    return best if best and rates[best] >= min_gain * rates[0] else 0


def should_continue(i: int, p_cum: float, a_next: float, d: float, V: CostFn, *,
                    expected_so_far: float | None = None, a_later: Sequence[float] | None = None,
                    k_max: int = 16) -> bool:
    """Token-by-token drafting: having drafted i tokens, is drafting more expected to raise tokens/s?

    ``p_cum`` = P(all i drafted tokens are accepted) = prod_{j<=i} a_j (from the acceptance
    statistics, the drafter's confidence or an acceptance head); ``expected_so_far`` = E(i) =
    1 + sum_{t<=i} prod_{j<=t} a_j, what stopping now is expected to emit (tracked by
    :class:`SequentialDraft`; when omitted, the lower bound 1 + i*p_cum is used, which can only
    make continuing look better than it is). ``a_next`` = a_{i+1}; ``a_later`` = a_{i+2}, ...
    (default: a_next repeated).

    Stopping now yields rate E(i)/T(i). Continuing to any k in i+1..k_max yields
    E(k)/T(k) with E(k) = E(i) + p_cum * sum_{t=i+1..k} prod_{j=i+1..t} a_j. Continue iff the best
    such k beats stopping. The look-ahead matters because V(k) is not convex nor even
    monotone: one more token can cost more than two.

    Consistency with :func:`best_draft_length`: fed the same a_j (p_cum and expected_so_far
    computed from them), continuing while this returns True stops at exactly
    ``best_draft_length(a, d, V, k_max)``, because that is the smallest maximiser of E/T: every
    i below it sees it as a strictly better continuation, and at it no larger k is strictly better.
    """
    if i < 0:
        raise ValueError("i must be >= 0")
    if i >= k_max:
        return False
    d = float(d)  # a DraftCost works too
    cost = _cost(V)
    e_now = expected_so_far if expected_so_far is not None else 1.0 + i * p_cum
    stop_rate = e_now / (i * d + cost(i))
    future = [a_next] + list(a_later or [])
    rates = _rates(future, k_max - i)
    e, p = e_now, p_cum
    for n, x in enumerate(rates, start=1):
        p *= x
        e += p
        k = i + n
        if e / (k * d + cost(k)) > stop_rate:
            return True
    return False


class SequentialDraft:
    """Book-keeping for :func:`should_continue` over one drafting round.

    >>> plan = SequentialDraft(d=0.004, V=costs, k_max=8)
    >>> while plan.should_continue(a_next=stats.rate(plan.i + 1)):
    ...     token, confidence = drafter.next()
    ...     plan.push(stats.rate(plan.i + 1))   # or the drafter's confidence for this token

    ``push(a)`` records the conditional acceptance probability of the token just drafted, so
    ``p_cum`` and ``expected`` (= E(i)) stay exact.
    """

    def __init__(self, d: float, V: CostFn, k_max: int) -> None:
        self.d, self.V, self.k_max = float(d), _cost(V), int(k_max)
        self.i, self.p_cum, self.expected = 0, 1.0, 1.0

    def push(self, a: float) -> None:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance probability must lie in [0, 1], got {a}")
        self.i += 1
        self.p_cum *= a
        self.expected += self.p_cum

    def should_continue(self, a_next: float, a_later: Iterable[float] | None = None) -> bool:
        return should_continue(self.i, self.p_cum, a_next, self.d, self.V, expected_so_far=self.expected,
                               a_later=None if a_later is None else list(a_later), k_max=self.k_max)
