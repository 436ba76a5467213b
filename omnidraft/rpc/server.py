"""``omnidraft serve``: the target on a server, behind gRPC; the drafter stays on the device.

One ``Verify`` call is one step of the loop's target half: append context, score it with the
proposals in one forward, verify them by the rule, reply with the number accepted and the next
token (and, for the online trainer, sparse log-probs of each emitted position). Only token ids
cross the wire, never logit rows.

Sessions hold a target KV cache each (engines share the weights). They are a cache, not the truth:
an unknown or evicted session, or a client that believes the session holds more than it does,
gets FAILED_PRECONDITION and resends its whole context, so any replica can serve any call. The
table is LRU-bounded (``max_sessions``) with an idle timeout. Every request is validated before
any model work (sizes: RESOURCE_EXHAUSTED; ids, rules, numbers: INVALID_ARGUMENT), one forward
runs at a time (the CPU has no more to give; an engine with a session pool serves every session
that has work in it: :class:`Batcher`), and a SIGTERM drains: health goes NOT_SERVING, calls in
flight finish, new ones are refused.
"""

from __future__ import annotations

import gc
import hashlib
import hmac
import io
import math
import tempfile
import threading
import time
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from omnidraft.console import notice
from omnidraft.costs import DRAFT_MIN_GAIN, AcceptanceStats, VerifyCosts, best_draft_length, expected_tokens
from omnidraft.errors import OmnidraftError
from omnidraft.rpc import prefix_digest
from omnidraft.rpc.proto import SERVICE_NAME, pb, services
from omnidraft.sources.lookup import LookupIndex
from omnidraft.sources.policy import OPTIMISTIC_ACCEPTANCE, Exploration
from omnidraft.target.base import cut, decide, settle_cache, step_generator
from omnidraft.verify import IDS_ONLY_RULES, MIN_TEMPERATURE, MIN_TEMPERATURE_F32
from omnidraft.verify.proposal import Proposal
from omnidraft.vocab.token_bytes import special_ids

DEFAULT_PORT = 50551
DEFAULT_MAX_SESSIONS = 8
DEFAULT_MAX_DRAFT = 32
MAX_LOGPROBS = 256
SESSION_IDLE_S = 600.0
TOKENIZER_CHUNK = 1 << 20
MAX_SESSION_ID = 128
MAX_FORKS = 32  # forks one Draft may carry
# a fork's drafted tokens past the correction it foresaw are kept about this often per token until a
# stream's own verifies say otherwise (SmolLM2 -> Qwen2.5-Coder-1.5B: 0.04-0.25; the line: 0.5-0.6)
FORK_PRIOR = 0.25


@dataclass
class Session:
    target: Any  # an engine with its own KV cache over the server's weights
    ids: list[int] = field(default_factory=list)  # what it holds: context + emitted tokens
    columns: torch.Tensor | None = None  # the trainer's log-prob columns, once sent
    columns_sha256: str = ""
    last_used: float = field(default_factory=time.monotonic)
    decoding: bool = False  # a Generate or Decode stream is writing it: other calls on it are refused
    plans: StreamPlans | None = None  # its streams' budgets, kept for its next request (None: no stream yet)


class Refused(Exception):
    """A request answered with a status code and a one-line reason."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class TargetService(services.TargetServicer):
    def __init__(self, target: Any, spec: str, engine: str, *, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 max_context: int | None = None, max_draft: int = DEFAULT_MAX_DRAFT, model_sha256: str = "") -> None:
        self.base, self.spec, self.engine = target, spec, engine
        self.compute_lock = threading.Lock()  # one forward at a time: two would only share the cores
        self.batcher = Batcher(target, self.compute_lock)
        batching = self.batcher.sessions > 1
        self.max_sessions = min(max_sessions, self.batcher.sessions) if batching else max_sessions  # a pool's slots
        self.max_draft = max_draft
        self.max_context = min(max_context or target.max_context, target.max_context)
        self.model_sha256 = model_sha256
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.table_lock = threading.Lock()
        self.tokenizer_zip = _zip_tokenizer(target.tokenizer)
        self.special_ids = special_ids(target.tokenizer)  # where the server's lookup copies end
        self.tokenizer_sha256 = hashlib.sha256(self.tokenizer_zip).hexdigest()
        self.mask_bytes = (target.vocab_size + 7) // 8
        self.verifies = 0
        self.budget = ProposalBudget(self.batcher.row_costs)

    # ---- RPCs

    def Info(self, request, context):
        return pb.InfoReply(spec=self.spec, model_sha256=self.model_sha256, engine=self.engine,
                            vocab_size=self.base.vocab_size, eos_ids=sorted(self.base.eos_ids),
                            max_context=self.max_context, max_draft=self.max_draft,
                            tokenizer_sha256=self.tokenizer_sha256, tokenizer_bytes=len(self.tokenizer_zip),
                            rules=list(IDS_ONLY_RULES), max_logprobs=MAX_LOGPROBS,
                            batch_sessions=self.batcher.sessions, forwards=self.batcher.forwards,
                            busy_s=self.batcher.busy_s, emitted=self.batcher.emitted)

    def Tokenizer(self, request, context):
        for start in range(0, len(self.tokenizer_zip), TOKENIZER_CHUNK):
            yield pb.TokenizerChunk(data=self.tokenizer_zip[start:start + TOKENIZER_CHUNK])

    def Close(self, request, context):
        with self.table_lock:
            return pb.CloseReply(closed=self.sessions.pop(request.session_id, None) is not None)

    def Generate(self, request, context):
        yield from self._decode(request, context, None)

    def Decode(self, messages, context):
        first = next(messages, None)
        if first is None or isinstance(first, Malformed) or first.WhichOneof("kind") != "start":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Decode stream starts with a GenerateRequest (start)")
        drafts = Drafts(self.base.vocab_size, self.max_context)
        threading.Thread(target=drafts.read, args=(messages,), daemon=True, name="omnidraft-drafts").start()
        yield from self._decode(first.start, context, drafts)

    def Verify(self, request, context):
        try:
            self._check(request)
            session = self._session(request)
            if session.decoding:
                raise Refused(grpc.StatusCode.ABORTED, "the session is decoding in a stream; use another session_id")
            context_ids = session.ids[: request.prefix_len] + list(request.append)
            if len(context_ids) + len(request.proposed) + 1 > self.max_context:
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"context {len(context_ids)} + {len(request.proposed)} proposals exceed the "
                              f"{self.max_context}-token limit of a session")
            columns = self._columns(session, request)
            config = SimpleNamespace(verify=request.rule or "greedy", temperature=float(request.temperature),
                                     top_p=float(request.top_p) or 1.0, seed=int(request.seed))
            proposed = list(request.proposed)
            logits, _ = self.batcher.score(session.target, context_ids + proposed, len(proposed))
            logits = _readable(logits, config, request.logprobs_k)
            proposal = Proposal(proposed) if proposed else None
            accepted, nxt = decide(logits, proposal, config, step_generator(config.seed, len(context_ids)))
            emitted = proposed[:accepted] + [nxt]
            self.batcher.count(len(emitted))
            session.ids = context_ids + emitted
            reply = pb.VerifyReply(accepted=accepted, next_token=nxt, held=len(session.ids))
            if request.logprobs_k:
                reply.rows.extend(_rows(logits[: len(emitted)], emitted, columns, request.logprobs_k))
            self.verifies += 1
            return reply
        except Refused as exc:
            context.abort(exc.code, str(exc))

    def _decode(self, r, context, drafts: Drafts | None):
        """Decode ``r.max_new_tokens`` tokens of a session, one message per forward. With ``drafts``
        (a Decode stream) each forward verifies what is usable of the device's latest draft; with
        none, it waits for the device's next only where that is expected to pay (:class:`Patience`),
        else it makes a plain step. Every position's randomness is
        ``step_generator(seed, position)``, so the tokens do not depend on the drafts."""
        try:
            self._check_generate(r)
            session = self._session(r)
            columns = self._columns(session, r)
            with self.table_lock:  # one stream at a time writes a session
                if session.decoding:
                    raise Refused(grpc.StatusCode.ABORTED, "the session is decoding in another stream; use another session_id")
                session.decoding = True
        except Refused as exc:
            context.abort(exc.code, str(exc))
        config = SimpleNamespace(verify=r.rule or "greedy", temperature=float(r.temperature),
                                 top_p=float(r.top_p) or 1.0, seed=int(r.seed))
        k_max = r.max_proposals or self.max_draft
        ids = session.ids[: r.prefix_len] + list(r.append)
        session.ids, new = ids, 0
        # the line's acceptance and the forks' apart: a fork goes on from the drafter's runner-up, where it was
        # less sure, and its drafts are kept less often; mixed in, they would shorten the line's verifies
        plans = session.plans = session.plans or StreamPlans.fresh(self.budget)
        plan, fork_plan, patience = plans.line, plans.forks, plans.patience
        patience.begin()
        lookup = ServerLookup(plans.lookup, ids, self.special_ids) if r.lookup else None
        forwards, rest, awake_at = 0, False, 0.0  # the device drafts from the stream's start
        self.batcher.join()
        try:
            while new < r.max_new_tokens and context.is_active():
                if drafts is not None and drafts.error:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, drafts.error)
                room = r.max_new_tokens - new - 1  # proposals that fit: the last token is the target's
                available = min(k_max, room)
                usable, forked = drafts.usable(ids, available) if drafts is not None and room > 0 else ([], False)
                waited, copied = 0.0, None  # copied: the server's lookup copy, once looked up this forward
                if not usable and forwards and drafts is not None and room > 0 and not rest:
                    copied = lookup.copy(available) if lookup is not None else []
                    if not copied:  # the device's next draft may be near
                        usable, forked, waited = patience.wait(drafts, ids, available, plan)
                if drafts is not None and room > 0:  # the device drafted if told to and it has sent since
                    # (a forward the server's own lookup serves needs no draft: it says nothing of the device's timing)
                    plan.heard(not rest and drafts.put_at > awake_at and not copied, bool(usable), available)
                chooser = fork_plan if forked else plan
                proposed = usable[: chooser.choose(len(usable))]
                if not proposed and lookup is not None and room > 0:  # no paying draft from the device
                    proposed = lookup.propose(available, copied)
                    chooser = lookup.plan if proposed else chooser
                logits, busy_s = self.batcher.score(session.target, ids + proposed, len(proposed))
                logits = _readable(logits, config, r.logprobs_k)
                accepted, nxt = decide(logits, Proposal(proposed) if proposed else None, config,
                                       step_generator(config.seed, len(ids)))
                busy_ms = busy_s * 1000
                chooser.learn(len(proposed), accepted, busy_s, reads_prompt=not forwards)
                verify_k = plan.wants(k_max) if drafts is not None else 0
                if rest and verify_k:  # woken: its drafts count once it has sent one after this
                    awake_at = time.monotonic()
                rest = drafts is not None and not verify_k
                rest_forks = drafts is not None and not fork_plan.wants(k_max)
                forwards += 1
                emitted, done = cut(proposed[:accepted] + [nxt], self.base.eos_ids, r.max_new_tokens - new)
                reply = pb.Emitted(position=len(ids), tokens=emitted, proposed=proposed,
                                   accepted=min(accepted, len(emitted)), done=done, busy_ms=busy_ms,
                                   usable=len(usable), rest=rest, server_lookup=lookup is not None and chooser is lookup.plan,
                                   forked=chooser is fork_plan and bool(proposed), rest_forks=rest_forks,
                                   waited_ms=waited * 1000, verify_k=verify_k)
                if r.logprobs_k:
                    reply.rows.extend(_rows(logits[: len(emitted)], emitted, columns, r.logprobs_k))
                ids.extend(emitted)
                if lookup is not None:
                    lookup.index.extend(emitted)
                new += len(emitted)
                session.last_used = time.monotonic()
                self.batcher.count(len(emitted))
                if done:  # settle and free the session before the client reads the last message and moves on
                    self._settle(session, ids)
                    session.decoding = False
                yield reply
                if done:
                    return
        finally:
            self.batcher.leave()
            if session.decoding:  # the stream ended early (cancelled, aborted)
                self._settle(session, ids)
            session.decoding = False

    def _settle(self, session: Session, ids: list[int]) -> None:
        """Let the session's engine keep only what it would hold had it decoded ``ids`` alone (see
        ``LocalVerifier.settle``): a stream with drafts then leaves the same cache as ``Generate``."""
        with self.compute_lock:
            settle_cache(session.target, ids)

    # ---- validation, before any model work

    def _check(self, r) -> None:
        """A ``Verify`` request."""
        self._check_request(r, r.proposed)

    def _check_generate(self, r) -> None:
        """A ``Generate`` request, or the first message of a ``Decode`` stream."""
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not 1 <= r.max_new_tokens <= self.max_context:
            raise Refused(bad, f"max_new_tokens must be in [1, {self.max_context}]")
        if not 0 <= r.max_proposals <= self.max_draft:
            raise Refused(bad, f"max_proposals must be in [0, {self.max_draft}]")
        self._check_request(r)
        if r.prefix_len + len(r.append) + r.max_new_tokens > self.max_context:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"context {r.prefix_len + len(r.append)} + {r.max_new_tokens} new tokens exceed the "
                          f"{self.max_context}-token limit of a session")

    def _check_ids(self, ids) -> None:
        vocab = self.base.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"token ids must be in [0, {vocab})")

    def _check_request(self, r, proposed=()) -> None:
        """What every request that starts work carries: the session, its context (and proposals), the sampling."""
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not r.session_id or len(r.session_id) > MAX_SESSION_ID:
            raise Refused(bad, f"session_id must be 1..{MAX_SESSION_ID} characters")
        if r.prefix_len < 0:
            raise Refused(bad, "prefix_len must be >= 0")
        if r.prefix_len + len(r.append) > self.max_context:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"context over the {self.max_context}-token limit")
        if len(proposed) > self.max_draft:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(proposed)} proposals, at most {self.max_draft}")
        self._check_ids(r.append)
        self._check_ids(proposed)
        if r.prefix_len + len(r.append) == 0:
            raise Refused(bad, "the context is empty")
        if (r.rule or "greedy") not in IDS_ONLY_RULES:
            raise Refused(bad, f"unknown rule {r.rule!r}; this server verifies {', '.join(IDS_ONLY_RULES)}")
        if not math.isfinite(r.temperature) or not 0 <= r.temperature <= 100:
            raise Refused(bad, "temperature must be a finite number in [0, 100]")
        if 0 < r.temperature < MIN_TEMPERATURE_F32:  # logits / T would overflow: garbage, not a sample
            raise Refused(bad, f"temperature {r.temperature:g} is too small to sample with: give 0 (greedy) "
                               f"or at least {MIN_TEMPERATURE:g}")
        if not math.isfinite(r.top_p) or not 0 <= r.top_p <= 1:
            raise Refused(bad, "top_p must be in (0, 1] (0: default 1)")
        if (r.rule == "text-sample") != (r.temperature > 0):
            raise Refused(bad, "text-sample needs a temperature above 0, greedy a temperature of 0")
        if not 0 <= r.logprobs_k <= MAX_LOGPROBS:
            raise Refused(bad, f"logprobs_k must be in [0, {MAX_LOGPROBS}]")
        if r.logprob_columns and len(r.logprob_columns) != self.mask_bytes:
            raise Refused(bad, f"logprob_columns must be a {self.mask_bytes}-byte bitmask")

    # ---- sessions

    def _session(self, r) -> Session:
        now = time.monotonic()
        with self.table_lock:
            for sid in [s for s, sess in self.sessions.items() if now - sess.last_used > SESSION_IDLE_S]:
                del self.sessions[sid]  # idle too long: its KV cache goes
            session = self.sessions.get(r.session_id)
            if session is None:
                if r.prefix_len:
                    raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "unknown session: resend the whole context")
                if len(self.sessions) >= self.max_sessions:  # the least recently used goes, unless it is decoding
                    idle = next((sid for sid, sess in self.sessions.items() if not sess.decoding), None)
                    if idle is None:
                        raise Refused(grpc.StatusCode.UNAVAILABLE,
                                      f"all {self.max_sessions} sessions are decoding; try again shortly")
                    del self.sessions[idle]
                session = self.sessions[r.session_id] = Session(self._new_engine_session())
            elif r.prefix_len > len(session.ids):
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"prefix mismatch: the session holds {len(session.ids)} tokens, not {r.prefix_len}")
            elif r.prefix_len and r.prefix_digest != prefix_digest(session.ids[: r.prefix_len]):
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              "prefix mismatch: the session holds other tokens (another replica's?): resend the context")
            self.sessions.move_to_end(r.session_id)
            session.last_used = now
            return session

    def _new_engine_session(self) -> Any:
        """A KV cache of its own. A batching engine has a fixed number of slots; an evicted session's
        slot comes back when its last reference goes (a handler may still hold it for a moment)."""
        try:
            return self.base.session()
        except RuntimeError:
            gc.collect()
            try:
                return self.base.session()
            except RuntimeError:
                raise Refused(grpc.StatusCode.UNAVAILABLE, "every session slot is in use; try again shortly") from None

    def _columns(self, session: Session, r) -> torch.Tensor | None:
        if not r.logprobs_k:
            return None
        if r.logprob_columns:
            bits = torch.frombuffer(bytearray(r.logprob_columns), dtype=torch.uint8)
            mask = ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[: self.base.vocab_size].bool()
            session.columns, session.columns_sha256 = torch.nonzero(mask).flatten(), hashlib.sha256(r.logprob_columns).hexdigest()
        if session.columns is None or (r.logprob_columns_sha256 and r.logprob_columns_sha256 != session.columns_sha256):
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "the session has no log-prob columns: resend them")
        if r.logprobs_k > len(session.columns):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "logprobs_k exceeds the number of columns")
        return session.columns


class _Job:
    """One session's forward, waiting to be run alone or with others."""

    def __init__(self, target: Any, ids: list[int], num_proposed: int) -> None:
        self.target, self.ids, self.num_proposed = target, ids, num_proposed
        self.logits: torch.Tensor | None = None
        self.seconds = 0.0  # the forward's time (a shared forward's whole time)
        self.error: BaseException | None = None


class Batcher:
    """Runs the sessions' forwards, one at a time on the engine. Where the engine can serve several
    sessions in one forward (``batch_sessions`` > 1: the static engine's session pool), the forward
    takes every session that has work: whoever holds the engine next takes all jobs queued meanwhile
    (leader and followers, no thread of its own), after waiting a little for each running stream to
    queue its next job, so that streams which all just got their tokens go together rather than one
    forward each: up to ``GATHER_SHARE`` of the last forward's time (at least ``GATHER_MIN_S``), since
    the streams' own work between forwards (the rule, the message) takes longer where forwards do (a
    CPU shared by the streams' threads). Keeps the server's counters: forwards, busy seconds, emitted
    tokens."""

    GATHER_SHARE = 0.05
    GATHER_MIN_S = 0.002

    def __init__(self, target: Any, compute_lock: threading.Lock) -> None:
        self.target, self.compute_lock = target, compute_lock
        self.sessions = int(getattr(target, "batch_sessions", 1))
        self.cond = threading.Condition()
        self.queue: list[_Job] = []
        self.streams = 0  # Generate and Decode loops running
        self.forwards, self.busy_s, self.emitted = 0, 0.0, 0
        self.last_forward_s = 0.0
        # a shared forward that costs by its rows (a CPU pool) charges each session by a fitted model
        self.row_costs = RowCosts() if self.sessions > 1 and getattr(target, "cost_by_rows", False) else None

    def join(self) -> None:
        with self.cond:
            self.streams += 1

    def leave(self) -> None:
        with self.cond:
            self.streams -= 1
            self.cond.notify_all()

    def count(self, emitted: int) -> None:
        with self.cond:
            self.emitted += emitted

    def score(self, target: Any, ids: list[int], num_proposed: int) -> tuple[torch.Tensor, float]:
        """``target.score(ids, num_proposed)``, possibly in a forward shared with other sessions; and
        the seconds of the forward (this session's charge for it, where rows cost: :class:`RowCosts`). A shared
        forward's rows stay on the engine's device: :func:`_readable` brings them to the host when
        the rule needs more than their argmax."""
        job = _Job(target, ids, num_proposed)
        with self.cond:
            self.queue.append(job)
            self.cond.notify_all()
        with self.compute_lock:
            while job.logits is None and job.error is None:  # not run meanwhile: lead forwards, oldest jobs first
                self._run(self._gather())
        if job.error is not None:
            raise job.error
        return job.logits, job.seconds

    def _gather(self) -> list[_Job]:
        with self.cond:
            if self.sessions > 1:
                window = max(self.GATHER_MIN_S, self.GATHER_SHARE * self.last_forward_s)
                self.cond.wait_for(lambda: len(self.queue) >= min(self.streams, self.sessions), timeout=window)
            jobs, self.queue = self.queue[: self.sessions], self.queue[self.sessions:]
            return jobs

    def _run(self, jobs: list[_Job]) -> None:
        if self.sessions > 1:
            rows = ([j.target.rows_to_read(j.ids, j.num_proposed) for j in jobs]
                    if self.row_costs is not None else None)
            self._timed(jobs, lambda: self.target.score_many([(j.target, j.ids, j.num_proposed) for j in jobs],
                                                             to_host=False), rows)
        else:
            for j in jobs:
                self._timed([j], lambda: [j.target.score(j.ids, j.num_proposed)])

    def _timed(self, jobs: list[_Job], forward, rows: list[int] | None = None) -> None:
        """One forward for ``jobs``; its logits, its time, or its failure go to each of them. With
        ``rows`` (a forward that costs by its rows) each job's time is its share by :class:`RowCosts`,
        so a session's verify looks as dear to the proposal budget as it is to the server."""
        start = time.perf_counter()
        try:
            results = forward()
        except Exception as exc:  # noqa: BLE001 - every stream in the forward gets the failure; the server goes on
            for j in jobs:
                j.error = exc
            return
        seconds = time.perf_counter() - start
        # the fit learns from decode rows only: a prompt is read on its own, at another price per row
        if rows and all(r == j.num_proposed + 1 for r, j in zip(rows, jobs)):
            self.row_costs.observe(sum(rows), seconds, len(rows))
        shares = self.row_costs.split(seconds, rows) if rows else [seconds] * len(jobs)
        for j, logits, share in zip(jobs, results, shares):
            j.logits, j.seconds = logits, share
        with self.cond:
            self.forwards += 1
            self.busy_s += seconds
            self.last_forward_s = seconds


class RowCosts:
    """What each session of a shared forward is charged, by the rows it read: an equal part of the
    forward's fixed time and a per-row price for each of its rows, both fitted by least squares
    (exponentially weighted) to the decode forwards' total rows and times, the fixed part divided by
    the usual number of sessions per forward. Where rows are nearly free (a one-pass kernel that reads
    the weights once for several rows) a session's verify rows then cost it about what they cost the
    server; and a plain step costs the same whether the forward it fell in was full or not (a charge
    that followed each forward's session count made the budget's V(k) noise: an exploration in a
    half-empty forward looked twice as dear). Until the forwards seen differ in rows, each session
    pays its rows' share of the forward."""

    DECAY = 0.98  # per forward: the fit follows the server's recent load and context lengths

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = self.ss = 0.0

    def observe(self, rows: int, seconds: float, sessions: int) -> None:
        d = self.DECAY
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + rows, d * self.sy + seconds
        self.sxx, self.sxy, self.ss = d * self.sxx + rows * rows, d * self.sxy + rows * seconds, d * self.ss + sessions

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per row), or None while the rows seen barely differ."""
        spread = self.n * self.sxx - self.sx * self.sx
        if self.n < 2 or spread <= 1e-9 * max(self.n * self.sxx, 1.0):
            return None
        per_row = max((self.n * self.sxy - self.sx * self.sy) / spread, 0.0)
        return max((self.sy - per_row * self.sx) / self.n, 0.0), per_row

    def split(self, seconds: float, rows: list[int]) -> list[float]:
        """Each session's charge for a forward of ``seconds`` that read ``rows`` (one count per session)."""
        cost = self.verify_cost()
        return [seconds * r / sum(rows) for r in rows] if cost is None else [cost(r - 1) for r in rows]

    def verify_cost(self) -> Callable[[int], float] | None:
        """A session's charge for a forward in which it verifies k proposals (k + 1 rows), at the
        usual sessions per forward; None until the forwards seen differ in rows."""
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_row = fitted
        share = fixed / (self.ss / self.n)  # the fixed part over the sessions per decode forward, recently
        return lambda k: share + per_row * (k + 1)


class ProposalBudget:
    """How many of a session's drafted tokens a forward verifies: the k that maximises the tokens the
    server emits per second of its own time (``costs.best_draft_length`` with no drafting cost: the
    device drafts on its own time), from this server's observed forward times by k (one table for
    every session, :attr:`costs`) and the session's acceptance (:class:`SessionBudget`). A verify that
    costs more than the tokens it is likely to save is not made, so a weak or late drafter leaves the
    server at its own speed.

    With ``row_costs`` (a pool whose forwards serve several sessions and cost by their rows) the
    forward times by k come from its fitted model once it has one: a table of charges observed at
    different times mixes loads (a verify timed while one session ran was charged the whole forward,
    a plain step with eight sessions an eighth of one), and verifies that look dear are never made,
    so the table is never corrected."""

    def __init__(self, row_costs: RowCosts | None = None) -> None:
        self.costs: VerifyCosts | None = None  # until a plain step is timed
        self.row_costs = row_costs
        self.lock = threading.Lock()

    def session(self, prior_mean: float = 0.5) -> SessionBudget:
        return SessionBudget(self, prior_mean)

    def _cost(self) -> Callable[[int], float] | None:
        """Seconds of this server's time for a forward that verifies k proposals (None: none timed)."""
        modelled = self.row_costs.verify_cost() if self.row_costs is not None else None
        return modelled or self.costs

    def best(self, acceptance: AcceptanceStats | float, available: int) -> int | None:
        """The paying k for this acceptance (None: no forward timed yet)."""
        with self.lock:
            cost = self._cost()
            if cost is None:
                return None
            rates = acceptance if isinstance(acceptance, float) else acceptance.rates(available)
            return best_draft_length(rates, 0.0, cost, available, DRAFT_MIN_GAIN)

    def gain(self, acceptance: AcceptanceStats, k: int) -> float:
        """A verify of k drafted tokens' tokens per second of server time over a plain step's: E(k) V(0) / V(k)."""
        with self.lock:
            cost = self._cost()
            return 1.0 if cost is None or not k else expected_tokens(acceptance.rates(k), k) * cost(0) / cost(k)

    def observe(self, k: int, seconds: float) -> None:
        with self.lock:
            if self.costs is None:
                if k == 0:
                    self.costs = VerifyCosts.flat(seconds)  # optimistic about k > 0 until observed
                return
            self.costs.observe(k, seconds)

    def explore_one(self, available: int, room: float) -> int:
        """1 where a one-token exploration could pay at all and its worst case (V(1) - V(0)) fits in
        ``room`` plain steps, else 0."""
        if not self.best(OPTIMISTIC_ACCEPTANCE, available):
            return 0
        with self.lock:
            cost = self._cost()
            return int(cost(1) - cost(0) <= room * cost(0))

    def worth_waiting(self, acceptance: AcceptanceStats, available: int) -> tuple[int, float]:
        """The k a draft of ``available`` tokens would be verified at, and the longest wait for it that
        still pays (0: none), by a renewal argument over one correction of the device's line.

        After a forward that corrected the line, the device's draft from the correction is a lag L
        away. Waiting for it: E(k) tokens in L + V(k). Not waiting: a plain step (V(0)) emits a token,
        which the draft's first token then matches with probability a_1, and the rest of the draft is
        verified (V(k - 1)): the same E(k) tokens on average, in V(0) + a_1 V(k - 1). So a wait pays
        while L < V(0) + a_1 V(k - 1) - V(k), never longer than one plain step."""
        k = self.best(acceptance, available)
        if not k:
            return 0, 0.0
        with self.lock:
            cost = self._cost()
            return k, max(cost(0) + acceptance.rate(1) * cost(k - 1) - cost(k), 0.0)

    def lost_steps(self, accepted: int, seconds: float) -> float:
        """Plain steps' worth of time a verifying forward lost against plain steps emitting its
        ``accepted`` + 1 tokens (negative: it won)."""
        with self.lock:
            cost = self._cost()
            return 0.0 if cost is None else seconds / cost(0) - (accepted + 1)


class SessionBudget:
    """One stream's side of :class:`ProposalBudget`: its acceptance, and when it explores. While
    drafting does not pay, a forward now and then verifies one drafted token anyway (when a draft
    could pay at all), so the estimates follow a drafter that improves; each exploration that lost
    time makes the next twice as rare, and all of them lose at most a small share of the stream's
    forwards (the decoder's :class:`~omnidraft.sources.policy.Exploration`), so a drafter that never
    pays costs the server almost nothing."""

    def __init__(self, budget: ProposalBudget, prior_mean: float = 0.5) -> None:
        self.budget = budget
        self.acceptance = AcceptanceStats(prior_mean=prior_mean, decay=0.98)
        self.exploration = Exploration()
        self.lateness = Lateness()

    def choose(self, available: int) -> int:
        if not available:
            self.exploration.skip()
            return 0
        k = self.budget.best(self.acceptance, available)
        if k is None:  # no plain step timed yet on this server: make one
            return 0
        return self.exploration.choose(k, lambda room: self.budget.explore_one(available, room))

    def wants(self, k_max: int) -> int:
        """The longest draft the next forward would verify: the budget's k for a full draft of
        ``k_max`` (0 while the device's drafts come too late to pay: :class:`Lateness`); where that is
        none, 1 if an exploration is due (the device drafts again, and the exploration waits for its
        draft), else 0: the device may stop drafting. ``k_max`` before any forward is timed."""
        k = self.budget.best(self.acceptance, k_max)
        if k is None:
            return k_max
        if k:
            return 0 if self.lateness.resting else k
        return int(self.exploration.due and bool(self.budget.explore_one(k_max, self.exploration.room)))

    def heard(self, drafting: bool, usable: bool, k_max: int) -> None:
        """Each forward of a Decode stream: whether the device was drafting (told to, and it had sent a
        draft since) and whether a draft of it was usable; see :class:`Lateness`."""
        k = self.budget.best(self.acceptance, k_max) if drafting else None
        self.lateness.forward(usable, self.budget.gain(self.acceptance, k) if k else None)

    def learn(self, k: int, accepted: int, seconds: float, reads_prompt: bool) -> None:
        """Fold one forward in; ``reads_prompt``: it also read the context, so its time is no step's."""
        if not reads_prompt:
            self.budget.observe(k, seconds)
            if k:
                self.exploration.settle(self.budget.lost_steps(accepted, seconds))
        self.acceptance.update(k, accepted)


class Lateness:
    """Whether the device's drafts reach the server in time to pay for the drafting.

    A draft is usable only if it arrives before the server has emitted past its start, or guessed
    what it emitted meanwhile. After each correction the device hears of it a round trip later,
    reads, drafts and sends, while the server goes on; where that takes a few of the server's
    forwards (a fast target, a long RTT) few drafts are usable. Drafting then pays the server
    ``timely x (gain - 1)`` over plain steps: the share of forwards that found a usable draft times
    what a verify gains (:meth:`ProposalBudget.gain`). Where that is under the least gain worth
    drafting for (``DRAFT_MIN_GAIN``), the device rests for ``backoff`` forwards and is then tried
    again; each try that is still late doubles the rest (up to ``MAX``), and one that stays timely for
    ``FIRST`` forwards resets it. A device drafting continuously for a draft used one forward in ten
    spends its battery (and on a host it shares with the server, the server's time) for little."""

    ALPHA = 0.2  # weight of the newest forward in the timely share
    FIRST = 16  # forwards of the first rest, and of a try that clears the device
    MAX = 256

    def __init__(self) -> None:
        self.timely = 1.0  # share of forwards while the device drafted that found a usable draft (from an optimistic start)
        self.rest_left = 0  # forwards the device rests for, before it is tried again
        self.backoff = self.FIRST
        self.tried = 0  # forwards observed since the device was last tried

    @property
    def resting(self) -> bool:
        return self.rest_left > 0

    def forward(self, usable: bool, gain: float | None) -> None:
        """One forward: ``gain`` is the verify's (None: the device was not drafting, or no draft would
        be verified, so nothing is learned about its timing)."""
        if self.rest_left:
            self.rest_left -= 1
            return
        if gain is None:
            return
        self.timely = (1 - self.ALPHA) * self.timely + self.ALPHA * usable
        self.tried += 1
        if self.timely * (gain - 1) < DRAFT_MIN_GAIN - 1:  # late: rest, then try again afresh
            self.rest_left, self.backoff = self.backoff, min(2 * self.backoff, self.MAX)
            self.timely, self.tried = 1.0, 0
        elif self.tried >= self.FIRST:  # on time: a later lateness rests it briefly again
            self.backoff = self.FIRST


class Patience:
    """How long one stream's forward waits for the device's draft when none it has is usable: after
    a forward that corrected the device's line, the next usable draft is a round trip and a few
    drafter tokens away. Where that lag is shorter than what a plain step would lose
    (:meth:`ProposalBudget.worth_waiting`: a near device, a slow target) the forward waits for the
    draft, for at most that long. Elsewhere (a GPU server's millisecond steps, a device a long RTT
    away) waits run out with nothing usable, and after ``MISSES`` of them in a row the stream steps at
    once for the rest of the request: a late device costs less than two plain steps per request. The
    lags of the waits a draft ended are averaged, and the stream also stops waiting once that average comes within
    ``MARGIN`` of the bound, where a wait gains little and the bound's estimates (the session's a_1
    from a few verifies, V(k) from noisy timings) err either way. The wait is this design's one
    departure from a server that never waits; the bench reports its seconds (docs/remote.md)."""

    ALPHA = 0.3  # weight of the newest lag
    MISSES = 2  # waits in a row that ran out: the device is too late for this request
    MARGIN = 0.8  # wait only while the average lag is below this share of the bound

    def __init__(self, budget: ProposalBudget) -> None:
        self.budget = budget
        self.lag_s: float | None = None  # seconds from a wait's start to a draft worth verifying, averaged
        self.misses = 0  # waits in a row that ran out

    def begin(self) -> None:
        """A new request of the session: the device may be on time again (its lag carries over)."""
        self.misses = 0

    def wait(self, drafts: Drafts, ids: list[int], available: int, plan: SessionBudget) -> tuple[list[int], bool, float]:
        """What is usable after waiting up to the paying time for a draft of the length ``plan`` would
        verify (nothing waited for where that is none, or while the device is too late), and the
        seconds waited."""
        want, worth = self.budget.worth_waiting(plan.acceptance, available)
        if worth <= 0 or self.misses >= self.MISSES or self.lag_s is not None and self.lag_s >= self.MARGIN * worth:
            return [], False, 0.0
        start = time.monotonic()
        usable, forked = drafts.wait(ids, available, want, worth)
        waited = time.monotonic() - start
        if not usable:  # the deadline came first
            self.misses += 1
        else:  # the device answered (with fewer than ``want`` tokens where its line stopped growing)
            self.misses = 0
            self.lag_s = waited if self.lag_s is None else (1 - self.ALPHA) * self.lag_s + self.ALPHA * waited
        return usable, forked, waited


@dataclass
class StreamPlans:
    """One session's budgets, kept across its requests: its device's line and forks, the server's own
    lookup, and the wait's patience. A request starts from the acceptance and the exploration budget
    the session's last one left, as the device's own policy does across requests; with a fresh even
    prior each request re-learned that a weak drafter does not pay with the verifies that lost, a few
    per request on a target whose verified rows are dear (llama.cpp on a CPU)."""

    line: SessionBudget
    forks: SessionBudget
    lookup: SessionBudget
    patience: Patience

    @classmethod
    def fresh(cls, budget: ProposalBudget) -> StreamPlans:
        return cls(budget.session(), budget.session(FORK_PRIOR), budget.session(), Patience(budget))


class ServerLookup:
    """Prompt lookup on the server (:class:`~omnidraft.sources.lookup.LookupIndex` over the stream's
    context): drafts for the forwards the device's drafts miss, with no round trip and nothing to
    send, as llama.cpp's server does with lookup decoding. Its acceptance and explorations are its
    own (a :class:`SessionBudget`); the forward times are the server's."""

    def __init__(self, plan: SessionBudget, ids: list[int], stops: frozenset[int]) -> None:
        self.index = LookupIndex(stops=stops)
        self.index.reset(ids)
        self.plan = plan

    def copy(self, k: int) -> list[int]:
        """Up to ``k`` tokens the context would copy now (before the plan decides whether they pay)."""
        return self.index.propose(k)[0]

    def propose(self, k: int, copied: list[int] | None = None) -> list[int]:
        """What of the copy (``copied``, where this forward already looked it up) the plan verifies."""
        copied = self.copy(k) if copied is None else copied
        return copied[: self.plan.choose(len(copied))]


class Drafts:
    """What a device drafted ahead in a Decode stream: target ids from position ``start`` on, along a
    main line and its forks.

    A reader thread puts each Draft message in as it arrives; each one is the device's whole
    continuation after the text it had heard, so it replaces the one before. A fork is where the
    device expects the target may correct its line (the drafter's runner-up there, drafted a few
    tokens on): after a forward that corrected the line, the next can still verify a draft that
    foresaw the correction, where the device would otherwise hear of it a round trip later. The
    decode loop takes the longest path that continues what it has emitted."""

    ALPHA = 0.2  # weight of the newest interval between chunks
    PAUSE = 2.0  # a chunk this many intervals late: the device's line has stopped growing

    def __init__(self, vocab_size: int, limit: int) -> None:
        self.vocab_size, self.limit = vocab_size, limit
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # a draft came, or the device's stream ended
        self.start, self.paths = 0, [[]]  # paths[0]: the main line; the others: the forks, in full from start
        self.error: str | None = None  # a bad message: the stream ends with INVALID_ARGUMENT
        self.ended = False  # no more drafts will come
        self.sent: tuple[int, int] = (-1, 0)  # the device's last draft as it sent it: (start, tokens)
        self.put_at = 0.0  # when it came
        self.chunk_s: float | None = None  # seconds between the drafts that lengthened one line, averaged

    def read(self, messages) -> None:
        try:
            for message in messages:
                if isinstance(message, Malformed) or message.WhichOneof("kind") != "draft":
                    self.error = "after the first message a Decode stream carries drafts only"
                    return
                d = message.draft
                self.put(d.start, list(d.tokens), [(f.at, list(f.tokens)) for f in d.forks])
                if self.error:
                    return
        except Exception:  # noqa: BLE001 - the stream ended or was cancelled: no more drafts
            return
        finally:
            with self.changed:
                self.ended = True
                self.changed.notify_all()

    def put(self, start: int, tokens: list[int], forks: Sequence[tuple[int, list[int]]] = ()) -> None:
        paths = [tokens] + [tokens[: at - start] + fork for at, fork in forks]
        if len(forks) > MAX_FORKS:
            self.error = f"a draft may carry at most {MAX_FORKS} forks"
        elif any(not fork or not start <= at <= start + len(tokens) for at, fork in forks):
            self.error = "a fork needs tokens and a position within its draft"
        elif start < 0 or any(start + len(path) > self.limit for path in paths):
            self.error = f"a draft must lie within the {self.limit}-token context"
        elif any(t < 0 or t >= self.vocab_size for path in paths for t in path):
            self.error = f"token ids must be in [0, {self.vocab_size})"
        if self.error:
            with self.changed:
                self.changed.notify_all()
            return
        now = time.monotonic()
        with self.changed:
            if start == self.sent[0] and len(tokens) > self.sent[1]:  # the next chunk of the same line
                gap = now - self.put_at
                self.chunk_s = gap if self.chunk_s is None else (1 - self.ALPHA) * self.chunk_s + self.ALPHA * gap
            self.sent, self.put_at = (start, len(tokens)), now
            self.start, self.paths = start, paths
            self.changed.notify_all()

    def usable(self, ids: list[int], k: int) -> tuple[list[int], bool]:
        """Up to ``k`` drafted tokens after ``ids`` along the longest path that agrees with all of
        ``ids`` it covers (what the server emitted meanwhile is trimmed off: a draft that foresaw it
        still counts), and whether that path is a fork. The paths that disagree are dropped."""
        with self.lock:
            return self._usable(ids, k)

    def wait(self, ids: list[int], k: int, want: int, timeout: float) -> tuple[list[int], bool]:
        """:meth:`usable`, once it holds ``want`` tokens, or what it holds after ``timeout`` seconds
        (or when the device's stream ends or turns out bad). Once something is usable the wait also
        ends when the device's next chunk is ``PAUSE`` times later than its chunks come: its line
        has stopped growing (it reached the end of a target token it cannot draft past, or the
        device's limit), and what came is verified now rather than at the deadline."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                usable, forked = self._usable(ids, k)
                now, end = time.monotonic(), deadline
                if usable and self.chunk_s is not None:
                    end = min(end, self.put_at + self.PAUSE * self.chunk_s)
                if len(usable) >= want or now >= end or self.ended or self.error:
                    return usable, forked
                self.changed.wait(end - now)

    def _usable(self, ids: list[int], k: int) -> tuple[list[int], bool]:
        offset = len(ids) - self.start
        if offset < 0:
            return [], False
        told = ids[self.start:]
        alive = [(i, path[offset:]) for i, path in enumerate(self.paths) if len(path) >= offset and path[:offset] == told]
        if not alive:
            self.start, self.paths = len(ids), [[]]
            return [], False
        best, rest = max(alive, key=lambda a: (len(a[1]), -a[0]))  # the longest; the main line on a tie
        self.start, self.paths = len(ids), [rest] + [p for i, p in alive if i != best]
        return rest[:k], best > 0


class Malformed:
    """What a request that is not a valid message deserializes to (answered INVALID_ARGUMENT)."""


def _lenient(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except Exception:  # noqa: BLE001 - any bytes may arrive; none may take the server down
            return Malformed()

    return parse


def _checked(method):
    """Refuse a malformed message before the method sees it."""
    def handler(request, context):
        if isinstance(request, Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request is not a valid message")
        return method(request, context)

    return handler


def _handlers(service: TargetService) -> grpc.GenericRpcHandler:
    """The service's methods with lenient parsing (generated registration would answer INTERNAL)."""
    unary = {"Info": (pb.InfoRequest, pb.InfoReply), "Verify": (pb.VerifyRequest, pb.VerifyReply),
             "Close": (pb.CloseRequest, pb.CloseReply)}
    table = {name: grpc.unary_unary_rpc_method_handler(_checked(getattr(service, name)), request_deserializer=_lenient(req),
                                                       response_serializer=rep.SerializeToString)
             for name, (req, rep) in unary.items()}
    table["Tokenizer"] = grpc.unary_stream_rpc_method_handler(
        _checked(service.Tokenizer), request_deserializer=_lenient(pb.TokenizerRequest),
        response_serializer=pb.TokenizerChunk.SerializeToString)
    table["Generate"] = grpc.unary_stream_rpc_method_handler(
        _checked(service.Generate), request_deserializer=_lenient(pb.GenerateRequest),
        response_serializer=pb.Emitted.SerializeToString)
    table["Decode"] = grpc.stream_stream_rpc_method_handler(  # each message is checked as the stream reads it
        service.Decode, request_deserializer=_lenient(pb.DecodeUp), response_serializer=pb.Emitted.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, table)


def _readable(logits: torch.Tensor, config: SimpleNamespace, logprobs_k: int) -> torch.Tensor:
    """The rows where the rule can read them: greedy without log-probs needs only each row's argmax,
    taken on the device that computed them (a few ids cross to the host instead of vocabulary-wide
    rows); sampling (drawn with the host's per-position generators) and log-probs read them here."""
    return logits if logits.device.type == "cpu" or argmax_only(config, logprobs_k) else logits.cpu()


def argmax_only(config: SimpleNamespace, logprobs_k: int) -> bool:
    """Whether a step reads nothing of its rows but their argmax (the greedy rule, no log-probs)."""
    return config.verify == "greedy" and config.temperature <= 0 and not logprobs_k


def _rows(logits: torch.Tensor, emitted: list[int], columns: torch.Tensor, k: int) -> list:
    from omnidraft.train.records import sparse_rows

    ids, logp, mass, emitted_logp = sparse_rows(logits, emitted, columns, k)
    return [pb.Row(ids=ids[i].tolist(), logprobs=logp[i].tolist(), log_mass=float(mass[i]),
                   logp_emitted=float(emitted_logp[i])) for i in range(len(emitted))]


def _zip_tokenizer(tokenizer: Any) -> bytes:
    """The tokenizer's files as one deterministic zip (its sha256 names it in the client's cache)."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for path in sorted(Path(tmp).iterdir()):
                info = zipfile.ZipInfo(path.name, date_time=(2020, 1, 1, 0, 0, 0))
                zf.writestr(info, path.read_bytes(), zipfile.ZIP_DEFLATED)
        return buf.getvalue()


class TokenAuth(grpc.ServerInterceptor):
    """``authorization: Bearer <token>`` on every call (health and reflection included), compared in
    constant time; anything else is UNAUTHENTICATED before a handler runs."""

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        handler = continuation(details)
        if handler is None or hmac.compare_digest(given.encode(), self.expected):
            return handler
        return _denied(handler)


def _denied(handler):
    """A handler of the same shape as ``handler`` that only says UNAUTHENTICATED."""
    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

    def deny_stream(request, context):
        deny(request, context)
        yield from ()

    kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
            else "stream_unary" if handler.stream_unary else "stream_stream")
    fn = deny_stream if kind.endswith("stream") else deny
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(fn, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


@dataclass
class Served:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    service: TargetService

    def drain(self, grace: float = 30.0) -> None:
        """NOT_SERVING first, so load balancers stop sending; calls in flight finish; new ones are refused."""
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.stop(grace).wait()
        with self.service.compute_lock:  # a handler past its grace may still be computing: let it finish
            with self.service.table_lock:
                self.service.sessions.clear()  # their KV caches go before the weights they point at


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def serve(target: Any, spec: str, engine: str, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
          token: str | None = None, tls: tuple[bytes, bytes] | None = None, insecure: bool = False,
          max_sessions: int = DEFAULT_MAX_SESSIONS, max_context: int | None = None,
          max_draft: int = DEFAULT_MAX_DRAFT, model_sha256: str = "", workers: int = 16) -> Served:
    """Start the service on ``host:port`` (0: any free port) and return it running."""
    if host not in LOOPBACK and not (token or tls) and not insecure:
        raise OmnidraftError(f"refusing to serve on {host} without a token or TLS: anyone who reaches it could use "
                             "the target; give --token-file / $OMNIDRAFT_TOKEN or --tls-cert/--tls-key, or --insecure")
    service = TargetService(target, spec, engine, max_sessions=max_sessions, max_context=max_context,
                            max_draft=max_draft, model_sha256=model_sha256)
    options = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=options,
                         interceptors=[TokenAuth(token)] if token else [])
    server.add_generic_rpc_handlers((_handlers(service),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, grpc.ssl_server_credentials([tls[::-1]])) if tls \
            else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OmnidraftError(f"cannot listen on {address}: {exc}") from None
    if not bound:
        raise OmnidraftError(f"cannot listen on {address}: the port is taken or the address is not this machine's")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Served(server, bound, health_servicer, service)


def log_start(served: Served, host: str) -> None:
    notice(f"serving {served.service.spec} ({served.service.engine}) on {host}:{served.port}; Ctrl-C or SIGTERM drains")
