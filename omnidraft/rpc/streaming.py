"""Streaming verification, the device's half: draft ahead of the server and never make it wait.

With one ``Verify`` per draft the server idles while the device drafts and both idle for every
round trip, so against a server that simply streams its own decode (``Generate``) a device drafter
loses at any real RTT. Over ``Decode`` (one bidirectional stream per request) the two overlap, as in
SpecEdge (arXiv 2505.17052) and AMUSD:

- the server decodes continuously; each forward verifies what is usable of the latest draft that
  continues what it has emitted, or is a plain step when there is none (``server.py``, ``Drafts``);
- the device drafts ahead on its own thread (:class:`Device`): on top of the emitted text it
  assumes its own unconfirmed proposals were kept (``ahead``), and sends each chunk as it is drafted;
- each forward's tokens come down as one message and go to the caller at once, drafting or not.
  Where they agree with ``ahead`` the device goes on; where they differ it drops ``ahead`` and its
  sources begin again on the emitted text;
- with forks on, the device also drafts, in the time it would wait, a few tokens on from its
  drafter's runner-ups: forks of its line that the server verifies after a correction they foresaw
  (``Device``; off by default: measured not to pay with the drafters so far, docs/remote.md);
- a message may tell the device to rest: the server's budget would verify none of a draft now and
  no exploration is due, so drafting would only spend the device's battery (and the server's time
  on messages). The device drafts again when a message no longer says so;
- a drafter slower per token than the server's forward (a CPU drafter against a GPU server) never
  has a draft ahead of it: the device then drafts nothing with it (``Pace``), and a request with
  nothing else the server lacks decodes over ``Generate`` with the server's own lookup.

The server picks every token by the rule with per-position randomness, so the output is the
target's own (greedy: identical; text-sample: the same sample for the same seed) whatever the
device drafted and whenever it arrived. A stream that breaks is reopened with the context the
server is believed to hold (FAILED_PRECONDITION: all of it), like a ``Verify`` session.

Steps come out as :class:`~omnidraft.sources.base.StepResult`, one per server forward, so the
decoder counts them as it counts local steps.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from omnidraft.config import DecodeConfig
from omnidraft.errors import OmnidraftError
from omnidraft.kv import common_prefix_len
from omnidraft.rpc import prefix_digest
from omnidraft.rpc.proto import pb
from omnidraft.sources.base import DraftSource, StepResult, StepTimes
from omnidraft.sources.lookup import ContextLookup
from omnidraft.sources.policy import DRAFTER, AheadPolicy
from omnidraft.verify.proposal import Proposal

if TYPE_CHECKING:
    from omnidraft.rpc.client import RemoteTarget
    from omnidraft.target.base import RowRequest

CHUNK = 2  # tokens a source drafts per message: small, so each reaches the server soon
AHEAD = 8  # the device drafts up to the draft the server would verify + this many tokens past what it has seen
FORK_DEPTH = 6  # drafter tokens a fork goes on past the runner-up it starts from
FORKS_KEPT = 8  # forks the device keeps at once (the nearest positions: the likeliest corrections)
READ_PIECE = 32  # drafter tokens of a long context read at a time: a stream that ends waits for one piece
SYNC = "target"  # the StepResult source name of tokens the server emitted beyond the device's draft
SERVER_LOOKUP = "server-lookup"  # the StepResult source name of proposals the server drafted by prompt lookup
STOP = object()


@dataclass
class _Message:
    due: float  # when it may be read (an injected network delay)
    value: object  # an Emitted, an RpcError, or None at the end of the stream


@dataclass
class _Seed:
    """A runner-up the drafter noted in a chunk it sent: a fork to deepen when the device has time."""

    base: int  # the context position the chunk was drafted after
    proposal: Proposal
    index: int  # the drafted position of the runner-up
    source: DraftSource

    @property
    def position(self) -> int:  # about where the fork leaves the line (drafter and target tokens differ)
        return self.base + self.index


def _seeds(base: int, proposal: Proposal, source: DraftSource, first: int = 0) -> list[_Seed]:
    """A seed at each drafted position of ``proposal`` from ``first`` on (its draft notes the runner-ups)."""
    return [_Seed(base, proposal, i, source) for i in range(first, len(proposal.draft.runners_up))]


@dataclass
class _Fork:
    """A deepened runner-up: from context position ``at`` on, ``tokens`` instead of the line's."""

    at: int
    tokens: list[int]
    seed: _Seed
    proposal: Proposal  # the whole path from the seed's base, with the runner-ups noted past the fork

    @property
    def depth(self) -> int:
        """Drafter tokens drafted past the runner-up."""
        return len(self.proposal.draft.tokens) - self.seed.index - 1

    def seeds(self) -> list[_Seed]:
        """Where the path may fork again once it is the line: the positions drafted past the runner-up."""
        return _seeds(self.seed.base, self.proposal, self.seed.source, self.seed.index + 1)


class Pace:
    """How fast the server forwards and the device's drafter drafts, kept across one target's requests.

    A drafter that takes longer per token than the server takes per forward never has a token ahead
    of it: the server has emitted each position before the draft for it arrives. There the device
    drafts nothing with its model (and reads no prompt for it) until the server slows down, as it
    does with more sessions per forward or a larger model. On a GPU server a CPU drafter is often
    that slow, and its drafting only cost the device time (and, at a stream's end, a wait for a
    prompt read in progress)."""

    ALPHA = 0.2  # weight of the newest observation

    def __init__(self) -> None:
        self.forward_s: float | None = None  # seconds between the server's messages (one per forward)
        self.token_s: float | None = None  # seconds per token the device's drafter drafts, its read aside
        self._last: float | None = None  # when this stream's last message came

    def begin(self) -> None:
        """A new stream: its first message comes after the prompt read, which is no forward's pace."""
        self._last = None

    def heard(self, at: float) -> None:
        if self._last is not None:
            self.forward_s = self._mix(self.forward_s, at - self._last)
        self._last = at

    def drafted(self, seconds: float, tokens: int) -> None:
        if tokens > 0 and seconds > 0:
            self.token_s = self._mix(self.token_s, seconds / tokens)

    @property
    def too_slow(self) -> bool:
        """The drafter cannot draft one token in the time of a server forward."""
        return self.forward_s is not None and self.token_s is not None and self.token_s >= self.forward_s

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ALPHA) * old + self.ALPHA * new


class Device(threading.Thread):
    """The device's drafting thread for one stream: it owns the draft sources while the stream lasts.

    It learns what the server emitted from :meth:`emitted` (called by the reader of the stream) and
    drafts whenever it is not ``AHEAD`` tokens beyond that and the draft the server said it would
    verify, one chunk at a time: where the server verifies one token a forward, drafting a full
    ``k_max`` ahead would be thrown away at each correction (the device's battery, and on a host it
    shares, the server's time). With forks on
    (``--branch-rows N``), in the time it would otherwise wait it forks its line where the target may
    correct it: the drafter's runner-up at a drafted position (right about 0.4 of the times its first
    choice is not), drafted up to ``FORK_DEPTH`` tokens on. That is a token tree's branches (SpecInfer
    §3) spread over time: a forward after a correction a fork foresaw verifies the fork at once, where
    the device would hear of the correction a round trip later."""

    def __init__(self, request: StreamRequest, ids: list[int], send: Callable[[int, list[int], list], None]) -> None:
        super().__init__(daemon=True, name="omnidraft-device")
        self.request, self.send = request, send
        self.text = list(ids)  # the emitted text as far as the device has heard
        self.ahead: list[int] = []  # its unconfirmed continuation, as sent
        self.forks: list[_Fork] = []  # other ways ``ahead`` may go
        self.seeds: list[_Seed] = []  # runner-ups not forked yet
        self.updates: queue.SimpleQueue = queue.SimpleQueue()
        self.source_at: dict[int, str] = {}  # position -> the source that drafted the token sent there
        self.error: BaseException | None = None
        self.limit = request.k_max + AHEAD  # until the server says how long a draft it would verify
        self.resting = False  # the server said drafts do not pay now: draft nothing until it says otherwise
        self.forks_resting = False  # the server said forks do not pay now: fork nothing until it says otherwise
        self.forks_taken = 0  # corrections a fork had foreseen
        self.retried_at = -1  # the text length at which the line was last drafted again from the text

    def emitted(self, position: int, tokens: list[int], rest: bool = False, rest_forks: bool = False,
                verify_k: int = 0) -> None:
        """A forward's tokens, and what the server said with them (``verify_k`` 0: nothing said)."""
        self.updates.put((position, tokens, rest, rest_forks, verify_k))

    def stop(self) -> None:
        self.updates.put(STOP)

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, which raises it
            self.error = exc

    def _loop(self) -> None:
        rewind = idle = False
        self._time_drafter()
        while True:
            block = self.resting or not (self._line_due(idle) or self._fork_work() is not None)
            while True:  # every update that has come, waiting for one only when there is nothing to draft
                try:
                    update = self.updates.get(block=block)
                except queue.Empty:
                    break
                if update is STOP:
                    return
                rewind |= self._hear(*update)
                idle = block = False
            if self.resting:
                continue
            if rewind:  # on the emitted text, and on the fork that foresaw it if one did
                for s in self.request.sources:
                    s.begin(self.text + self.ahead, self.request.config, self.request.policy)
                rewind = False
            if self._line_due(idle):
                if not self._draft():
                    rewind = self._retry()
                    idle = not rewind
            elif (work := self._fork_work()) is not None:
                self._fork(work)

    def _hear(self, position: int, tokens: list[int], rest: bool, rest_forks: bool, verify_k: int) -> bool:
        """Take one forward's message (:meth:`emitted`); True: the sources must begin again."""
        self.resting, self.forks_resting = rest, rest_forks
        k_max = self.request.k_max
        self.limit = (verify_k if 0 < verify_k < k_max else k_max) + AHEAD  # 0 (or nonsense): not said
        return self._follow(position, tokens)

    def _retry(self) -> bool:
        """After a chunk that drafted nothing: whether to draft the line again from the emitted text.
        On top of its own unconfirmed tokens (a word that re-tokenizes across them) the device begins
        again from the text, once per text it has heard: the drafter drafts the same line again, so
        a second try without news would only resend it and delay hearing the server. After that it
        keeps what it sent and waits; on the text itself there is no line, and no fork of one."""
        if not self.ahead:
            self._drop(ahead=True)
            return False
        if self.retried_at == len(self.text):
            return False
        self.retried_at = len(self.text)
        self._drop(ahead=True)
        return True

    def _time_drafter(self) -> None:
        """The drafter's seconds per token, once per target (``Pace``): without it a request whose
        answer comes before the first draft (a prompt's read takes longer) never learns it."""
        pace = self.request.pace
        for source in self.request.sources:
            if pace.token_s is None and not source.free and hasattr(source, "token_seconds"):
                pace.drafted(source.token_seconds(self.text), 1)

    def _line_due(self, idle: bool) -> bool:
        """Whether to draft the line on (forks wait until it is ``limit`` ahead: they never delay it)."""
        return (not idle and len(self.ahead) < self.limit and self.request.room(self.text, self.ahead) > 0
                and not (self.ahead and self.ahead[-1] in self.request.eos_ids))

    def _fork_work(self) -> _Seed | _Fork | None:
        """What to fork next, CHUNK drafter tokens at a time so that news from the server waits little:
        the earliest runner-up the forward in flight or the next may reach (while forks are few
        enough), else the shallowest fork not yet ``FORK_DEPTH`` deep."""
        if self.forks_resting:
            return None
        reach = len(self.text) + self.request.k_max
        seeds = [s for s in self.seeds if s.position <= reach] if len(self.forks) < FORKS_KEPT else []
        if seeds:
            return min(seeds, key=lambda s: s.position)
        shallow = [f for f in self.forks if f.depth < FORK_DEPTH]
        return min(shallow, key=lambda f: (f.depth, f.at)) if shallow else None

    def _follow(self, position: int, tokens: list[int]) -> bool:
        """Keep what of ``ahead`` (or of a fork) agrees with what the server emitted; True: the sources
        must begin again."""
        if position != len(self.text):
            raise OmnidraftError(f"the server streamed position {position}, the device expected {len(self.text)}")
        self.text += tokens
        agreed = common_prefix_len(self.ahead, tokens)
        if agreed == len(tokens):
            del self.ahead[:agreed]
            self.forks = [f for f in self.forks if f.at >= len(self.text)]
            self.seeds = [s for s in self.seeds if s.base + len(s.proposal.proposed) > len(self.text)]
            return False
        fork = self._foreseen(position, tokens)
        if fork is None and agreed == len(self.ahead):  # the server went past the draft: the sources follow the text
            beyond = StepResult(source=SYNC, key="", free=False, proposal=None, drafted=0, accepted=0,
                                emitted=tokens[agreed:], done=False, rows=None, times=StepTimes())
            for s in self.request.sources:
                s.accept(beyond)
            self._drop(ahead=True)
            return False
        path = self.ahead[: fork.at - position] + fork.tokens if fork is not None else []
        self._drop(ahead=True)  # the server corrected the line, or went past it as a fork foresaw
        if fork is not None:
            self.ahead, self.seeds = path[len(tokens):], fork.seeds()
            self.forks_taken += 1
            for j in range(len(self.ahead)):
                self.source_at[len(self.text) + j] = DRAFTER
        return True

    def _foreseen(self, position: int, tokens: list[int]) -> _Fork | None:
        """The fork whose path from ``position`` agrees with ``tokens`` and goes furthest past them."""
        best, reach = None, len(tokens)
        for fork in self.forks:
            path = self.ahead[: fork.at - position] + fork.tokens
            if len(path) > reach and path[: len(tokens)] == tokens:
                best, reach = fork, len(path)
        return best

    def _drop(self, ahead: bool) -> None:
        self.forks, self.seeds = [], []
        if ahead:
            self.ahead = []

    def _publish(self) -> None:
        self.send(len(self.text), list(self.ahead), [(f.at, f.tokens) for f in self.forks])  # all of it, each time

    def _draft(self) -> bool:
        """One chunk from the first source with an offer, sent at once; every source follows it as if
        it had been kept. Before a model drafts, a long context is read a piece per call. False: nothing
        to draft on this text (wait for the server)."""
        request = self.request
        request.between()
        context = self.text + self.ahead
        room = request.room(self.text, self.ahead)
        for source in request.sources:
            offer = source.offer(context, room)
            if offer is None or not source.free and request.pace.too_slow:
                continue
            k = offer.limit if source.free else min(CHUNK, offer.limit)
            if not source.free and hasattr(source, "read") and source.read(context, k, READ_PIECE):
                return True  # a piece of the context read: news from the server is heard before the next
            while True:
                start = time.perf_counter()
                proposal = source.draft(context, offer, k, StepTimes())
                if not source.free and proposal.draft is not None:
                    draft = proposal.draft
                    request.pace.drafted(time.perf_counter() - start - draft.read_s, len(draft.tokens))
                proposal.proposed = until_eos(proposal.proposed[:room], request.eos_ids)
                if proposal.proposed or k >= offer.limit:
                    break
                k = min(2 * k, offer.limit)  # the chunk ended inside a target token: draft on to its end
            if not proposal.proposed:
                return False
            n = len(proposal.proposed)
            for j in range(n):
                self.source_at[len(context) + j] = source.name
            self.ahead += proposal.proposed
            self._publish()
            drafted = len(proposal.draft.tokens) if proposal.draft is not None else n
            assumed = StepResult(source=source.name, key=offer.key, free=source.free, proposal=proposal,
                                 drafted=drafted, accepted=n, emitted=list(proposal.proposed), done=False,
                                 rows=None, times=StepTimes(), kept=n)
            for s in request.sources:
                s.accept(assumed)
            if proposal.draft is not None and hasattr(source, "deepen"):
                self.seeds += _seeds(len(context), proposal, source)
            return True
        return False

    def _fork(self, work: _Seed | _Fork) -> None:
        """Fork the line at a runner-up, or take a fork CHUNK tokens deeper; send it if it is (still) one."""
        line = self.text + self.ahead
        if isinstance(work, _Seed):
            seed, fork = work, None
            self.seeds.remove(seed)
            proposal = seed.source.deepen(line[: seed.base], seed.proposal, seed.index, CHUNK)
        else:
            seed, fork = work.seed, work
            self.forks.remove(fork)
            proposal = seed.source.extend(line[: seed.base], fork.proposal, CHUNK)
        if proposal is None:
            return
        path = proposal.proposed
        at = common_prefix_len(path, line[seed.base:])
        tokens = path[at: at + self.request.room(self.text, line[len(self.text): seed.base + at])]
        if not tokens or seed.base + at < len(self.text):  # no fork, or one the text has gone past
            return
        self.forks.append(_Fork(seed.base + at, tokens, seed, proposal))
        if fork is None or tokens != fork.tokens or seed.base + at != fork.at:  # the server hears of it
            self._publish()


class StreamRequest:
    """One request over ``Generate`` (no sources) or ``Decode``; see the module docstring."""

    def __init__(self, remote: RemoteTarget, sources: Sequence[DraftSource], policy: AheadPolicy, config: DecodeConfig,
                 rows: RowRequest | None, between: Callable[[], None]) -> None:
        self.remote, self.sources, self.config, self.rows, self.between = remote, list(sources), config, rows, between
        self.policy = policy  # the sources began the request with it
        self.emitted = 0  # tokens of this request the server emitted so far
        self.k_max = min(config.draft_len, remote.max_draft)
        self.half_rtt = remote.rtt_s / 2
        self.eos_ids = remote.eos_ids  # the device's line ends at the target's end of sequence
        self.prompt_len = 0
        self.pace: Pace = remote.pace

    def room(self, text: list[int], ahead: list[int]) -> int:
        """Proposals that can still be verified after ``text + ahead`` (the request's last token is the target's)."""
        return self.config.max_new_tokens - (len(text) - self.prompt_len) - len(ahead) - 1

    def steps(self, ids: list[int]) -> Iterator[StepResult]:
        """One StepResult per server forward; the caller appends each one's tokens to ``ids``."""
        self.prompt_len = len(ids)
        attempt = 0
        while True:
            try:
                for step in self._stream(ids, self.config.max_new_tokens - self.emitted):
                    attempt = 0
                    yield step
                    if step.done:
                        return
                return  # the server ended the stream at max_new_tokens
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.FAILED_PRECONDITION and self.remote.server_ids:
                    self.remote.reset()  # the server does not hold what we believed: resend all of it
                elif code == grpc.StatusCode.UNAVAILABLE and attempt < self.remote.retries:
                    time.sleep(0.2 * 2**attempt)
                    attempt += 1
                else:
                    raise OmnidraftError(self.remote.explain(code, exc.details() or "")) from None
                for s in self.sources:  # the new stream starts from the emitted text
                    s.begin(ids, self.config, self.policy)

    # ---- one stream

    def _stream(self, ids: list[int], remaining: int) -> Iterator[StepResult]:
        remote = self.remote
        prefix = common_prefix_len(remote.server_ids, ids)
        start = pb.GenerateRequest(session_id=remote.session_id, prefix_len=prefix, append=ids[prefix:],
                                   prefix_digest=prefix_digest(ids[:prefix]) if prefix else b"",
                                   max_new_tokens=remaining, rule=_rule(self.config), temperature=self.config.temperature,
                                   top_p=self.config.top_p, seed=self.config.seed, max_proposals=self.k_max,
                                   lookup=any(s.name == ContextLookup.name for s in self.sources))  # lookup on: the server looks up too
        if self.rows is not None:
            remote.columns_into(start, self.rows)
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        device = None
        self.pace.begin()
        if self._drafts_up():
            call = remote.stub.Decode(self._up(pb.DecodeUp(start=start), outbox), metadata=remote.metadata)
            device = Device(self, ids, lambda position, tokens, forks: self._send(outbox, position, tokens, forks))
            device.start()
        else:
            remote.bytes_sent += start.ByteSize()
            time.sleep(self.half_rtt)
            call = remote.stub.Generate(start, metadata=remote.metadata)
        remote.calls += 1
        threading.Thread(target=self._down, args=(call, inbox), daemon=True, name="omnidraft-stream").start()
        try:
            yield from self._read(ids, inbox, device)
        finally:
            outbox.put(None)
            call.cancel()
            if device is not None:
                device.stop()
                device.join()

    def _drafts_up(self) -> bool:
        """Whether the request streams drafts up (``Decode``) or the server decodes alone (``Generate``,
        looking up in the context itself where our lookup is on). A drafter slower per token than the
        server's forward never has a token ahead of it (``Pace``), and the context lookup is the one
        the server makes without a round trip: with nothing else to offer, a ``Decode`` stream only
        costs messages, a device thread and the drafter's reads on both sides."""
        return any(s.name != ContextLookup.name if s.free else not self.pace.too_slow for s in self.sources)

    def _read(self, ids: list[int], inbox: queue.SimpleQueue, device: Device | None) -> Iterator[StepResult]:
        prompt = len(ids)  # the first forward reads the context too: its time is no plain step's
        while True:
            try:
                item = inbox.get(timeout=self.remote.deadline_s)
            except queue.Empty:
                raise OmnidraftError(f"the target at {self.remote.url} sent nothing for "
                                     f"{self.remote.deadline_s:g} s (deadline exceeded)") from None
            time.sleep(max(item.due - time.monotonic(), 0.0))
            message = item.value
            if device is not None and device.error is not None:
                raise device.error
            if message is None:
                return
            if isinstance(message, grpc.RpcError):
                raise message
            self.pace.heard(time.monotonic())
            if message.position != len(ids):
                raise OmnidraftError(f"the target at {self.remote.url} streamed position {message.position}, "
                                     f"expected {len(ids)}")
            tokens, proposed = list(message.tokens), list(message.proposed)
            if device is not None:
                device.emitted(message.position, tokens, message.rest, message.rest_forks, message.verify_k)
            self.remote.server_ids = ids + tokens
            self.remote.timely_forwards += message.usable > 0
            self.remote.forked_forwards += message.forked
            self.remote.waited_s += message.waited_ms / 1000
            if not proposed and message.position > prompt:
                self.remote.plain_busy_s.append(message.busy_ms / 1000)
            self.emitted += len(tokens)
            source = (SERVER_LOOKUP if message.server_lookup else DRAFTER if message.forked else
                      device.source_at.get(message.position, DRAFTER) if device is not None else None) if proposed else None
            free = source == SERVER_LOOKUP or source is not None and any(s.free for s in self.sources if s.name == source)
            yield StepResult(source=source, key="", free=free, proposal=Proposal(proposed) if proposed else None,
                             drafted=len(proposed), accepted=message.accepted, emitted=tokens, done=message.done,
                             rows=self.remote.sparse(message.rows) if self.rows is not None else None,
                             times=StepTimes(verify_s=message.busy_ms / 1000), kept=message.accepted)

    # ---- the wire

    def _send(self, outbox: queue.SimpleQueue, position: int, tokens: list[int], forks: list[tuple[int, list[int]]]) -> None:
        message = pb.DecodeUp(draft=pb.Draft(start=position, tokens=tokens,
                                             forks=[pb.Fork(at=at, tokens=fork) for at, fork in forks]))
        self.remote.bytes_sent += message.ByteSize()
        self.remote.fork_messages += bool(forks)
        outbox.put(_Message(time.monotonic() + self.half_rtt, message))

    def _up(self, first, outbox: queue.SimpleQueue):
        """The request stream: the start, then each draft when its injected delay has passed."""
        self.remote.bytes_sent += first.ByteSize()
        time.sleep(self.half_rtt)
        yield first
        while (item := outbox.get()) is not None:
            time.sleep(max(item.due - time.monotonic(), 0.0))
            yield item.value

    def _down(self, call, inbox: queue.SimpleQueue) -> None:
        """Every reply into ``inbox`` with its arrival time plus the injected delay; then None or the error."""
        try:
            for message in call:
                self.remote.bytes_received += message.ByteSize()
                inbox.put(_Message(time.monotonic() + self.half_rtt, message))
            inbox.put(_Message(0.0, None))
        except grpc.RpcError as exc:
            inbox.put(_Message(0.0, None if exc.code() == grpc.StatusCode.CANCELLED else exc))


def until_eos(tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
    """``tokens`` up to and with the first end of sequence: the request ends there."""
    return next((tokens[: j + 1] for j, t in enumerate(tokens) if t in eos_ids), tokens)


def _rule(config: DecodeConfig) -> str:
    return "greedy" if config.temperature <= 0 else "text-sample"
