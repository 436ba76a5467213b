"""A target on a server (``--target grpc://HOST:PORT`` or ``grpcs://``) as the decoder's verifier.

The device keeps the drafter and sends only token ids: per step the context tokens the server does
not hold yet (usually none), the proposals, and the rule; it gets back the number accepted and the
next token. What makes speculation worth it over a network is tokens per round trip: one ``Verify``
per drafted step instead of one per token.

The client keeps what it believes the server holds for its session and sends only the rest. The
server's sessions are a cache: FAILED_PRECONDITION (evicted, restarted, another replica) means the
whole context is sent again, transparently. UNAVAILABLE is retried with backoff; every call has a
deadline; a refused token, permission, size or deadline is one line. The tokenizer comes from the
server once and is kept under ``<home>/models/remote/`` by its sha256, so a device needs nothing
of the target locally. ``bytes_sent`` / ``bytes_received`` count message payloads each way.
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
import shutil
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import grpc
import torch

from omnidraft.errors import OmnidraftError
from omnidraft.home import home_dir
from omnidraft.kv import common_prefix_len
from omnidraft.rpc import prefix_digest
from omnidraft.rpc.proto import pb, services
from omnidraft.rpc.streaming import Pace, StreamRequest
from omnidraft.target.base import RowRequest, SparseRows, Verdict
from omnidraft.verify import IDS_ONLY_RULES
from omnidraft.verify.proposal import Proposal, SamplingConfig

if TYPE_CHECKING:
    from omnidraft.sources.base import DraftSource, StepResult
    from omnidraft.sources.policy import AheadPolicy

SCHEMES = ("grpc://", "grpcs://")
PROTOCOLS = ("stream", "verify")
DEFAULT_DEADLINE_S = 30.0
RETRIES = 5  # UNAVAILABLE: 0.2 + 0.4 + 0.8 + 1.6 + 3.2 s of backoff before giving up


def is_remote(spec: str) -> bool:
    return spec.startswith(SCHEMES)


class _Resend(Exception):
    """The server does not hold what we believed: send the whole context again."""


class RemoteTarget:
    """:class:`~omnidraft.target.base.Verifier` over gRPC (see the module docstring)."""

    rules = IDS_ONLY_RULES  # only ids cross the wire

    def __init__(self, url: str, *, token: str | None = None, home=None, deadline_s: float = DEFAULT_DEADLINE_S,
                 rtt_ms: float = 0.0, retries: int = RETRIES, protocol: str = "stream") -> None:
        """``protocol``: "stream" decodes each request over one stream (``Generate`` for the target
        alone, ``Decode`` with drafts: streaming verification); "verify" makes one ``Verify`` call
        per step (a round trip per draft, or per token for the target alone)."""
        if protocol not in PROTOCOLS:
            raise OmnidraftError(f"unknown remote protocol {protocol!r}; choose {' or '.join(PROTOCOLS)}")
        self.protocol = protocol
        parsed = urlparse(url)
        if parsed.scheme not in ("grpc", "grpcs") or not parsed.hostname or not parsed.port:
            raise OmnidraftError(f"bad remote target {url!r}: use grpc://HOST:PORT or grpcs://HOST:PORT")
        self.url, self.deadline_s, self.rtt_s, self.retries = url, deadline_s, rtt_ms / 1000.0, retries
        target = f"{parsed.hostname}:{parsed.port}" if ":" not in parsed.hostname else f"[{parsed.hostname}]:{parsed.port}"
        if parsed.scheme == "grpcs":
            roots = os.environ.get("OMNIDRAFT_TLS_CA")
            creds = grpc.ssl_channel_credentials(Path(roots).read_bytes() if roots else None)
            self.channel = grpc.secure_channel(target, creds)
        else:
            self.channel = grpc.insecure_channel(target)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.stub = services.TargetStub(self.channel)
        self.bytes_sent = self.bytes_received = self.calls = 0
        self.timely_forwards = 0  # stream forwards that began with a usable draft (verified or not)
        self.forked_forwards = 0  # stream forwards that verified a fork of the device's draft (a correction it foresaw)
        self.waited_s = 0.0  # seconds stream forwards waited on the server for the device's draft
        self.plain_busy_s: list[float] = []  # the server's time on each stream forward that verified nothing (not a prompt's)
        self.fork_messages = 0  # drafts sent up with forks (the device forks its line in the time it would wait)
        self.pace = Pace()  # the server's forwards and the device's drafter, timed across requests
        info = self._call(self.stub.Info, pb.InfoRequest())
        self.info = info
        self.spec, self.engine = info.spec, info.engine
        self.vocab_size, self.max_context, self.max_draft = info.vocab_size, info.max_context, info.max_draft
        self.eos_ids = frozenset(info.eos_ids)
        self.tokenizer = self._tokenizer(info, home)
        self.session_id = uuid.uuid4().hex
        self.server_ids: list[int] = []  # what we believe the server holds for our session
        self._columns_sha: str | None = None

    # ---- the verifier

    @property
    def streams(self) -> bool:
        """Requests run as one stream each (:meth:`steps`), not one ``verify`` call per step."""
        return self.protocol == "stream"

    def steps(self, ids: list[int], sources: Sequence[DraftSource], policy: AheadPolicy, config: SamplingConfig,
              rows: RowRequest | None, between: Callable[[], None]) -> Iterator[StepResult]:
        """The request as the server decodes it, one step per server forward (``streaming.py``)."""
        return StreamRequest(self, sources, policy, config, rows, between).steps(ids)

    def with_protocol(self, protocol: str) -> RemoteTarget:
        """The same server and tokenizer over ``protocol``, in a session of its own (the bench's modes)."""
        twin = copy.copy(self)
        twin.protocol, twin.session_id, twin.server_ids, twin._columns_sha = protocol, uuid.uuid4().hex, [], None
        return twin

    def verify(self, ids: Sequence[int], proposal: Proposal | None, config: SamplingConfig,
               rows: RowRequest | None) -> Verdict:
        proposed = list(proposal.proposed)[: self.max_draft] if proposal is not None else []
        rule = config.verify if proposal is not None else ("greedy" if config.temperature <= 0 else "text-sample")
        request = pb.VerifyRequest(session_id=self.session_id, proposed=proposed, rule=rule,
                                   temperature=config.temperature, top_p=config.top_p, seed=config.seed)
        ids = list(ids)
        common = common_prefix_len(self.server_ids, ids)
        try:
            reply = self._verify(request, ids, common, rows)
        except _Resend:
            self._columns_sha = None
            reply = self._verify(request, ids, 0, rows)
        self.server_ids = ids + proposed[: reply.accepted] + [reply.next_token]
        return Verdict(reply.accepted, reply.next_token, self.sparse(reply.rows) if rows is not None else None)

    def _verify(self, request, ids: list[int], prefix: int, rows: RowRequest | None):
        request.prefix_len, request.prefix_digest = prefix, prefix_digest(ids[:prefix]) if prefix else b""
        del request.append[:]
        request.append.extend(ids[prefix:])
        if rows is not None:
            self.columns_into(request, rows)
        return self._call(self.stub.Verify, request)

    def columns_into(self, request, rows: RowRequest) -> None:
        """Ask ``request`` for the trainer's log-probs; the columns' mask travels once per session."""
        mask = _mask_bytes(rows.columns)
        sha = hashlib.sha256(mask).hexdigest()
        request.logprobs_k = rows.k
        request.logprob_columns_sha256 = sha
        request.logprob_columns = mask if sha != self._columns_sha else b""
        self._columns_sha = sha

    @staticmethod
    def sparse(rows) -> SparseRows:
        """The log-prob rows of a reply as the trainer takes them."""
        return _sparse(rows)

    def settle(self, ids: Sequence[int]) -> None:
        """Nothing to do here: the server settles a session's cache when a stream ends. With the
        per-step ``verify`` protocol the server cannot tell where a request ended, and its cache may
        keep drafted tokens past it (the next request then reads a shorter span)."""

    def reset(self) -> None:
        """Forget what the server held (the next call sends the whole context, and the columns)."""
        self.server_ids = []
        self._columns_sha = None

    def new_session(self) -> None:
        """Drop this session's KV cache on the server and start another: the next request reads its
        whole context (a bench run must not find the previous run's prompt cached)."""
        self._forget_session()
        self.session_id = uuid.uuid4().hex
        self.reset()

    def server_info(self):
        """The server's ``Info`` now: its limits, and its counters (forwards, busy seconds, tokens
        emitted) for measuring what a run cost it."""
        return self._call(self.stub.Info, pb.InfoRequest())

    def close(self) -> None:
        self._forget_session()
        self.channel.close()

    def _forget_session(self) -> None:
        """Ask the server to drop this session; best effort (a server that is gone holds nothing)."""
        try:
            self.stub.Close(pb.CloseRequest(session_id=self.session_id), timeout=2, metadata=self.metadata)
        except grpc.RpcError:
            return

    # ---- calls

    def _call(self, method, request):
        self.bytes_sent += request.ByteSize()
        for attempt in range(self.retries + 1):
            if self.rtt_s:
                time.sleep(self.rtt_s)  # an injected round trip (bench: what a network adds)
            try:
                reply = method(request, timeout=self.deadline_s, metadata=self.metadata)
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAVAILABLE and attempt < self.retries:
                    time.sleep(0.2 * 2**attempt)
                    continue
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    raise _Resend from None
                raise OmnidraftError(self.explain(code, exc.details() or "")) from None
            self.calls += 1
            self.bytes_received += reply.ByteSize()
            return reply
        raise AssertionError("unreachable")

    def explain(self, code: grpc.StatusCode, details: str) -> str:
        where = f"the target at {self.url}"
        return {
            grpc.StatusCode.UNAUTHENTICATED: f"{where} refused the token ({details}); set $OMNIDRAFT_TOKEN or --token-file",
            grpc.StatusCode.PERMISSION_DENIED: f"{where} denied the request ({details})",
            grpc.StatusCode.RESOURCE_EXHAUSTED: f"{where} refused the request as too large ({details})",
            grpc.StatusCode.DEADLINE_EXCEEDED: f"{where} did not answer within {self.deadline_s:g} s (deadline exceeded)",
            grpc.StatusCode.UNAVAILABLE: f"cannot reach {where} after {self.retries + 1} tries ({details})",
            grpc.StatusCode.INVALID_ARGUMENT: f"{where} refused the request ({details})",
        }.get(code, f"{where} failed: {code.name} ({details})")

    def _tokenizer(self, info, home):
        """The server's tokenizer, fetched once and kept by its sha256 (checked)."""
        from transformers import AutoTokenizer

        folder = home_dir(home) / "models" / "remote" / info.tokenizer_sha256[:16]
        if not (folder / ".complete").is_file():
            data = b"".join(chunk.data for chunk in self._stream(self.stub.Tokenizer, pb.TokenizerRequest()))
            if hashlib.sha256(data).hexdigest() != info.tokenizer_sha256:
                raise OmnidraftError(f"the tokenizer from {self.url} does not match its checksum; try again")
            _unpack(data, folder)
        return AutoTokenizer.from_pretrained(folder)

    def _stream(self, method, request):
        try:
            for chunk in method(request, timeout=max(self.deadline_s, 120.0), metadata=self.metadata):
                self.bytes_received += chunk.ByteSize()
                yield chunk
        except grpc.RpcError as exc:
            raise OmnidraftError(self.explain(exc.code(), exc.details() or "")) from None


def _unpack(data: bytes, folder: Path) -> None:
    """Extract the tokenizer zip into ``folder`` atomically, refusing any path that leaves it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tok-"))
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            for name in zf.namelist():
                if "/" in name or "\\" in name or name.startswith(".") or not name:
                    raise OmnidraftError(f"the tokenizer sent by the server holds an unsafe file name {name!r}")
                (tmp / name).write_bytes(zf.read(name))
        (tmp / ".complete").write_text("ok\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except zipfile.BadZipFile:
        raise OmnidraftError("the tokenizer sent by the server is not a zip file") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _mask_bytes(columns: torch.Tensor) -> bytes:
    """A bool [vocab] tensor as a little-endian bitmask (bit j of byte i is id 8i + j)."""
    bits = columns.to(torch.uint8)
    pad = (-len(bits)) % 8
    if pad:
        bits = torch.cat([bits, torch.zeros(pad, dtype=torch.uint8)])
    weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)
    return (bits.view(-1, 8) * weights).sum(1).to(torch.uint8).numpy().tobytes()


def _sparse(rows) -> SparseRows:
    return SparseRows(torch.tensor([list(r.ids) for r in rows], dtype=torch.int32),
                      torch.tensor([list(r.logprobs) for r in rows], dtype=torch.float32),
                      torch.tensor([r.log_mass for r in rows], dtype=torch.float32),
                      torch.tensor([r.logp_emitted for r in rows], dtype=torch.float32))
