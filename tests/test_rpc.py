"""The target behind gRPC: a real server on 127.0.0.1 (port 0) with the real Qwen2.5-Coder-0.5B, the
real client as the decoder's verifier, and the CLI (`omnidraft serve`, `--target grpc://…`)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace

import grpc
import pytest
from conftest import DRAFTER, TEST_HOME

from omnidraft import models
from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.errors import OmnidraftError
from omnidraft.runtime import encode_prompt, make_drafter
from omnidraft.vocab.bridge import VocabBridge

TARGET = "builtin:qwen2.5-coder-0.5b"
TOKEN = "s3cret-token-for-tests"
FUZZ_REQUESTS = int(os.environ.get("OMNIDRAFT_FUZZ_REQUESTS", "300"))  # CI: 300; a longer run: set it
PROMPTS = [("Write a Python function that returns the n-th Fibonacci number.", True), ("def merge_sort(xs):\n", False)]


@pytest.fixture(scope="module")
def local_target():
    from omnidraft.target.llamacpp import LlamaCppTarget

    tok = models.load_tokenizer(TARGET, TEST_HOME, progress=False)
    target = LlamaCppTarget(models.gguf_of(TARGET, TEST_HOME, progress=False), tok, n_ctx=2048)
    yield target
    target.close()


@pytest.fixture(scope="module")
def server(local_target):
    from omnidraft.rpc.server import serve

    served = serve(local_target, TARGET, "llamacpp", port=0, token=TOKEN, max_sessions=2)
    yield served
    served.drain(grace=1)


def remote(server, home, **kw):
    """A client; one Verify per step unless ``protocol="stream"`` (the stream tests below)."""
    from omnidraft.rpc.client import RemoteTarget

    kw.setdefault("protocol", "verify")
    return RemoteTarget(f"grpc://127.0.0.1:{server.port}", token=kw.pop("token", TOKEN), home=home, **kw)


def decoder_for(target, real_models):
    d_model, d_tok = real_models(DRAFTER)
    bridge = VocabBridge(d_tok, target.tokenizer, int(d_model.get_output_embeddings().weight.shape[0]), target.vocab_size)
    return SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)


FORCED = dict(max_new_tokens=32, draft_len=4, draft_stop="fixed")  # every step drafts: every step a Verify


def memory_bound_costs(service, monkeypatch) -> None:
    """Give ``service`` the verify costs of a memory-bound target (every short verify costs one step,
    as on a GPU or behind a long round trip) and let it learn none. Whether a draft pays depends on
    this host's costs (on a slow 2-core CPU a verify of a few rows costs more than the tokens a 0.5
    prior expects, and the server rightly verifies nothing), so a test of the streaming mechanism
    holds them; the choice of k is tested in test_proposal_budget and test_costs."""
    from omnidraft.costs import VerifyCosts
    from omnidraft.rpc.server import ProposalBudget

    budget = ProposalBudget()
    budget.costs = VerifyCosts.flat(1.0)
    monkeypatch.setattr(budget, "observe", lambda k, seconds: None)
    monkeypatch.setattr(service, "budget", budget)


@pytest.mark.real
@pytest.mark.parametrize("config", [DecodeConfig(**FORCED), DecodeConfig(**FORCED, verify="text-sample", temperature=0.8, seed=7)],
                         ids=["greedy", "text-sample"])
def test_output_through_the_server_is_the_local_output(server, local_target, real_models, tmp_path, config):
    client = remote(server, tmp_path)
    assert client.tokenizer.get_vocab() == local_target.tokenizer.get_vocab()  # fetched from the server, checked
    through, local = decoder_for(client, real_models), decoder_for(local_target, real_models)
    for text, chat in PROMPTS:
        ids = encode_prompt(local_target.tokenizer, text, chat=chat)
        assert through.generate(ids, config).token_ids == local.generate(ids, config).token_ids
        assert through.stats.target_forwards < through.stats.new_tokens  # more than one token per round trip
    per_token = client.bytes_sent / max(through.stats.new_tokens, 1)
    assert 0 < per_token < 200 and client.calls > 0  # token ids, never logit rows (a row is 600 KB)
    client.close()


@pytest.mark.real
def test_a_wrong_or_missing_token_is_unauthenticated(server, tmp_path):
    for token in ("wrong", None):
        with pytest.raises(OmnidraftError, match="refused the token"):
            remote(server, tmp_path, token=token)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # health and reflection need the token too


@pytest.mark.real
def test_a_prefix_of_other_tokens_is_refused_not_verified(server, local_target):
    """The same session id on another replica may hold other tokens of the same length: the request
    names its prefix by digest, and a mismatch is FAILED_PRECONDITION (the client resends), never a
    verdict on the wrong text."""
    from omnidraft.rpc import prefix_digest
    from omnidraft.rpc.proto import pb, services

    stub = services.TargetStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    md = (("authorization", f"Bearer {TOKEN}"),)
    held = stub.Verify(pb.VerifyRequest(session_id="digest", append=[9, 8, 7]), metadata=md, timeout=30).held
    other, same = pb.VerifyRequest(session_id="digest", prefix_len=3, prefix_digest=prefix_digest([9, 8, 6])), \
        pb.VerifyRequest(session_id="digest", prefix_len=3, prefix_digest=prefix_digest([9, 8, 7]))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Verify(other, metadata=md, timeout=30)
    assert held == 4 and refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.Verify(same, metadata=md, timeout=30).held == 4


@pytest.mark.real
def test_an_evicted_session_is_resumed_transparently(server, local_target, real_models, tmp_path):
    a, b, c = (remote(server, tmp_path) for _ in range(3))  # the server keeps 2 sessions: each call evicts one
    ids = encode_prompt(local_target.tokenizer, "def add(a, b):\n")
    config = DecodeConfig(**FORCED)
    expected = decoder_for(local_target, real_models).generate(ids, config).token_ids
    for client in (a, b, c, a, b, c):
        assert decoder_for(client, real_models).generate(ids, config).token_ids == expected


@pytest.mark.real
def test_concurrent_sessions_give_each_client_its_output_alone(server, local_target, real_models, tmp_path):
    from types import SimpleNamespace

    from omnidraft.experiments.capacity import markdown, run_capacity

    pipe = SimpleNamespace(decoder=decoder_for(local_target, real_models))
    prompts = [encode_prompt(local_target.tokenizer, "def add(a, b):\n")]
    rows = run_capacity(pipe, lambda: remote(server, tmp_path), prompts, [1, 3], DecodeConfig(max_new_tokens=12))
    assert [(r.clients, r.drafting) for r in rows] == [(1, False), (1, True), (3, False), (3, True)]
    assert [r.tokens for r in rows] == [12, 12, 36, 36]  # every client got all its tokens (3 > max_sessions)
    assert all(r.identical for r in rows if not r.drafting)  # plain decoding: one-token evals, no near-ties
    assert all(0 < r.round_trips <= r.tokens for r in rows)
    assert all(r.server_forwards == r.round_trips and r.server_busy_s > 0 for r in rows)  # its own counters: no batching
    assert "| 3 | yes | 36 |" in markdown(rows, "meta")


@pytest.mark.real
def test_a_tiny_deadline_is_one_clear_line(server, tmp_path):
    client = remote(server, tmp_path)
    client.deadline_s = 0.001
    with pytest.raises(OmnidraftError, match="deadline exceeded"):
        client.verify(list(range(100, 300)), None, DecodeConfig(), None)


@pytest.mark.real
def test_malformed_and_hostile_requests_leave_the_server_up(server, local_target, tmp_path):
    """A bounded fuzz run: random bytes, out-of-range ids, huge drafts, unknown sessions, bad numbers."""
    from omnidraft.rpc.proto import pb, services

    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = services.TargetStub(channel)
    md = (("authorization", f"Bearer {TOKEN}"),)
    raw = channel.unary_unary("/omnidraft.v1.Target/Verify")  # bytes in, no serializer: the server must parse
    rng = random.Random(2026)
    vocab = local_target.vocab_size
    codes: dict[str, int] = {}
    start = time.monotonic()
    for i in range(FUZZ_REQUESTS):
        kind = i % 8
        try:
            if kind == 0:
                raw(rng.randbytes(rng.randrange(1, 400)), timeout=10, metadata=md)
            elif kind == 6:  # a wrong or missing token
                bad = rng.choice([(), (("authorization", "Bearer nope"),), (("authorization", f"Bearer {TOKEN}x"),)])
                stub.Verify(pb.VerifyRequest(session_id=f"s{i}", append=[100, 101], rule="greedy"), timeout=10, metadata=bad)
            elif kind == 7:  # a well-formed step of a new session, between the hostile ones
                stub.Verify(pb.VerifyRequest(session_id=f"ok{i}", append=[rng.randrange(vocab) for _ in range(4)],
                                             proposed=[rng.randrange(vocab)], rule="greedy"), timeout=10, metadata=md)
            else:
                req = pb.VerifyRequest(session_id=rng.choice(["", "x" * 500, f"s{i}"]), prefix_len=rng.choice([0, 0, 5, -3, 10**12]),
                                       append=[rng.choice([1, -1, vocab, 2**31 - 1, 100]) for _ in range(rng.randrange(0, 5))],
                                       proposed=[rng.randrange(-5, vocab + 5) for _ in range(rng.choice([0, 3, 500]))],
                                       rule=rng.choice(["greedy", "text-sample", "bogus", ""]),
                                       temperature=rng.choice([0.0, 0.7, float("nan"), float("inf"), -1.0]),
                                       top_p=rng.choice([0.0, 1.0, 2.0, float("nan")]), logprobs_k=rng.choice([0, 5, 10**6]),
                                       logprob_columns=rng.choice([b"", b"\x01" * 3]))
                stub.Verify(req, timeout=10, metadata=md)
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.RpcError as exc:
            codes[exc.code().name] = codes.get(exc.code().name, 0) + 1
    print(f"fuzz: {FUZZ_REQUESTS} requests in {time.monotonic() - start:.1f}s -> {codes}")
    assert "UNKNOWN" not in codes and "INTERNAL" not in codes and set(codes) <= {
        "OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "UNAUTHENTICATED"}
    assert codes.get("OK", 0) >= FUZZ_REQUESTS // 8 and codes.get("UNAUTHENTICATED", 0) >= FUZZ_REQUESTS // 8
    assert_still_serving_the_targets_output(channel, md, remote(server, tmp_path), local_target)


def assert_still_serving_the_targets_output(channel, md, client, local_target) -> None:
    """After a fuzz run: health says SERVING and a fresh client gets the target's own greedy output."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5, metadata=md)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    ids = encode_prompt(local_target.tokenizer, "print('hello')")
    assert SpeculativeDecoder(client).generate(ids, DecodeConfig(max_new_tokens=8)).token_ids == \
        SpeculativeDecoder(local_target).generate(ids, DecodeConfig(max_new_tokens=8)).token_ids


# ---- streaming: Generate (the server alone) and Decode (streaming verification)


class Paced:
    """The real target with every forward taking at least ``seconds``: a server slower than the
    device's drafter, as a big target without a GPU is, so that drafts reach it in time on any CI
    machine (the streaming mechanism is what is under test; its speed is measured by the bench)."""

    def __init__(self, target, seconds: float) -> None:
        self.target, self.seconds = target, seconds

    def __getattr__(self, name):
        return getattr(self.target, name)

    def session(self):
        return Paced(self.target.session(), self.seconds)

    def score(self, ids, num_proposed):
        start = time.monotonic()
        logits = self.target.score(ids, num_proposed)
        time.sleep(max(self.seconds - (time.monotonic() - start), 0.0))
        return logits


@pytest.fixture(scope="module")
def paced_server(local_target):
    from omnidraft.rpc.server import serve

    served = serve(Paced(local_target, 0.25), TARGET, "llamacpp", port=0, token=TOKEN, max_sessions=2)
    yield served
    served.drain(grace=1)


@pytest.mark.real
@pytest.mark.parametrize("config", [DecodeConfig(max_new_tokens=24, lookup=False),
                                    DecodeConfig(max_new_tokens=24, lookup=False, verify="text-sample", temperature=0.8,
                                                 seed=7)],
                         ids=["greedy", "text-sample"])
def test_streaming_verification_gives_the_targets_own_output(paced_server, local_target, real_models, tmp_path, config,
                                                            monkeypatch):
    """Drafts streamed up while the server decodes: the tokens are the target's own (greedy, and the
    same sample for the same seed), and drafts that arrived in time were kept. Lookup is off, so every
    verified forward verified the device's drafter (the server's own lookup has a test below). The
    server holds memory-bound costs (:func:`memory_bound_costs`), so after a correction its forward
    waits for the device's next draft (a few drafter tokens away, against a quarter-second step)."""
    memory_bound_costs(paced_server.service, monkeypatch)
    client = remote(paced_server, tmp_path, protocol="stream")
    through, alone = decoder_for(client, real_models), SpeculativeDecoder(local_target)
    tokens = forwards = accepted = verified = 0
    for text, chat in PROMPTS:
        ids = encode_prompt(local_target.tokenizer, text, chat=chat)
        assert through.generate(ids, config).token_ids == alone.generate(ids, config).token_ids
        tokens, forwards = tokens + through.stats.new_tokens, forwards + through.stats.target_forwards
        accepted += through.stats.accepted_tokens + through.stats.lookup_accepted
        verified += through.stats.steps - through.stats.plain_steps
    assert accepted > 0 and forwards < tokens  # the device's drafts saved server forwards
    assert verified <= client.timely_forwards < forwards  # a forward verifies only a draft that had arrived
    assert client.waited_s > 0  # some forwards waited for the device's draft after a correction
    # the server's plain steps, as the bench reports them: the paced forward's time, none of a prompt's first forward
    assert client.plain_busy_s and min(client.plain_busy_s) >= 0.24 and len(client.plain_busy_s) <= forwards - len(PROMPTS)
    assert 0 < client.bytes_sent / tokens < 200  # token ids, never logit rows
    client.close()


@pytest.mark.real
def test_the_device_forks_its_line_while_it_waits_and_the_output_stays_the_targets(local_target, real_models, tmp_path,
                                                                                  monkeypatch):
    """A server much slower than the drafter: the device has its line drafted well before each forward
    ends, and forks it where the drafter noted a runner-up; the server verifies a fork only after a
    correction it foresaw (test_stream_forks.py; how often: the bench's bracketed share). The tokens
    are the target's own either way. Without ``--branch-rows`` (forks are opt-in) none is sent. The
    server holds memory-bound costs (:func:`memory_bound_costs`)."""
    from omnidraft.rpc.server import serve

    served = serve(Paced(local_target, 0.8), TARGET, "llamacpp", port=0, token=TOKEN, max_sessions=2)
    memory_bound_costs(served.service, monkeypatch)
    client = remote(served, tmp_path, protocol="stream")
    through, alone = decoder_for(client, real_models), SpeculativeDecoder(local_target)
    config = DecodeConfig(max_new_tokens=20, lookup=False, draft_len=4, branch_rows=8)
    for text, chat in PROMPTS:
        ids = encode_prompt(local_target.tokenizer, text, chat=chat)
        assert through.generate(ids, config).token_ids == alone.generate(ids, config).token_ids
    sent, forked = client.fork_messages, client.forked_forwards
    assert sent > 0 and forked <= client.timely_forwards
    ids = encode_prompt(local_target.tokenizer, *PROMPTS[0])
    assert through.generate(ids, replace(config, branch_rows=-1)).token_ids == alone.generate(ids, config).token_ids
    assert client.fork_messages == sent and client.forked_forwards == forked
    client.close()
    served.drain(grace=1)


@pytest.mark.real
def test_server_stream_is_the_target_alone_in_one_call(server, local_target, tmp_path):
    client = remote(server, tmp_path, protocol="stream")
    ids = encode_prompt(local_target.tokenizer, "def add(a, b):\n")
    calls = client.calls
    decoder = SpeculativeDecoder(client)
    out = decoder.generate(ids, DecodeConfig(max_new_tokens=12)).token_ids
    assert out == SpeculativeDecoder(local_target).generate(ids, DecodeConfig(max_new_tokens=12)).token_ids
    assert client.calls - calls == 1 and decoder.stats.target_forwards == 12  # one stream, one forward per token
    client.close()


@pytest.mark.real
def test_the_server_drafts_by_prompt_lookup_where_the_device_sends_nothing(server, local_target, monkeypatch):
    """A Decode stream that asks for lookup and never sends a draft: the server proposes from the
    context itself, and the tokens are those of Generate (the server alone); the server holds
    memory-bound costs (:func:`memory_bound_costs`)."""
    import threading

    from omnidraft.rpc.proto import pb, services

    memory_bound_costs(server.service, monkeypatch)

    stub = services.TargetStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    md = (("authorization", f"Bearer {TOKEN}"),)
    ids = encode_prompt(local_target.tokenizer, "Repeat exactly: alpha beta gamma delta epsilon zeta eta theta iota kappa.\n"
                        "alpha beta gamma delta epsilon zeta eta theta iota kappa.\nalpha beta gamma delta")
    request = dict(append=ids, max_new_tokens=24)
    alone = [t for m in stub.Generate(pb.GenerateRequest(session_id="alone", **request), metadata=md, timeout=60)
             for t in m.tokens]
    finished = threading.Event()

    def up():
        yield pb.DecodeUp(start=pb.GenerateRequest(session_id="looks-up", lookup=True, **request))
        finished.wait(60)  # no drafts: the device has nothing to say

    messages = list(stub.Decode(up(), metadata=md, timeout=60))
    finished.set()
    assert [t for m in messages for t in m.tokens] == alone
    looked_up = [m for m in messages if m.server_lookup]
    assert looked_up and all(m.proposed and not m.usable for m in looked_up)
    assert sum(m.accepted for m in looked_up) > 0 and len(messages) < len(alone)  # it saved forwards


@pytest.mark.real
def test_a_stream_whose_session_is_gone_resends_its_context(server, local_target, real_models, tmp_path):
    client = remote(server, tmp_path, protocol="stream")
    decoder, config = decoder_for(client, real_models), DecodeConfig(max_new_tokens=10)
    ids = encode_prompt(local_target.tokenizer, "def add(a, b):\n")
    ids += decoder.generate(ids, config).token_ids + local_target.tokenizer.encode("\n\ndef sub(a, b):\n")
    held = len(client.server_ids)
    server.service.sessions.clear()  # a restart, or another replica behind the balancer
    assert decoder.generate(ids, config).token_ids == SpeculativeDecoder(local_target).generate(ids, config).token_ids
    assert held > 0 and client.bytes_sent > 0  # it had believed the server held its context, and resent it


@pytest.mark.real
def test_hostile_decode_streams_leave_the_server_up_and_exact(server, local_target, tmp_path):
    """A bounded fuzz of the streaming RPC: bytes that are no message, a stream that does not start with a
    request, drafts with bad ids or positions, bad numbers, a second start, streams cancelled midway."""
    from omnidraft.rpc.proto import pb

    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    md = (("authorization", f"Bearer {TOKEN}"),)
    decode = channel.stream_stream("/omnidraft.v1.Target/Decode", request_serializer=lambda m: m if isinstance(m, bytes)
                                   else m.SerializeToString(), response_deserializer=pb.Emitted.FromString)
    rng, vocab = random.Random(31), local_target.vocab_size
    codes: dict[str, int] = {}
    sent = 0

    def start(i: int, **kw) -> pb.DecodeUp:
        fields = dict(session_id=f"f{i}", append=[rng.randrange(vocab) for _ in range(3)], max_new_tokens=3)
        return pb.DecodeUp(start=pb.GenerateRequest(**(fields | kw)))

    def draft(position: int, tokens: list[int], forks=()) -> pb.DecodeUp:
        return pb.DecodeUp(draft=pb.Draft(start=position, tokens=tokens, forks=[pb.Fork(at=a, tokens=t) for a, t in forks]))

    for i in range(FUZZ_REQUESTS // 3):
        kind = i % 6
        if kind == 0:
            messages = [rng.randbytes(rng.randrange(1, 200)) for _ in range(rng.randrange(1, 4))]
        elif kind == 1:
            messages = [draft(3, [1, 2])]
        elif kind == 2:
            messages = [start(i), rng.choice([draft(3, [vocab]), draft(-1, [5]), draft(10**12, [5]), draft(3, [7] * 10**5),
                                              start(i), rng.randbytes(20), draft(3, [5], [(2, [6])]), draft(3, [5], [(3, [])]),
                                              draft(3, [5], [(4, [-1])]), draft(3, [5], [(3, [6])] * 10**3),
                                              draft(3, [5], [(10**12, [6])])])]
        elif kind == 3:
            messages = [start(i, **rng.choice([{"max_new_tokens": 0}, {"max_new_tokens": 10**9}, {"max_proposals": -1},
                                               {"max_proposals": 10**6}, {"temperature": float("nan")}, {"rule": "bogus"},
                                               {"session_id": ""}, {"prefix_len": 7}, {"append": []}]))]
        else:  # drafts, some with forks (valid ones: the server may verify them)
            def ids(n: int) -> list[int]:
                return [rng.randrange(vocab) for _ in range(n)]

            messages = [start(i)] + [draft(3 + j, ids(4), [(3 + j + rng.randrange(5), ids(rng.randrange(1, 4)))] * (j % 2))
                                     for j in range(3)]
        sent += len(messages)
        try:
            replies = decode(iter(messages), timeout=30, metadata=md)
            for n, _ in enumerate(replies):
                if kind == 4:  # cancelled after its first token
                    replies.cancel()
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.RpcError as exc:
            codes[exc.code().name] = codes.get(exc.code().name, 0) + 1
    print(f"fuzz: {sent} messages in {FUZZ_REQUESTS // 3} streams -> {codes}")
    assert "UNKNOWN" not in codes and "INTERNAL" not in codes and set(codes) <= {
        "OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "CANCELLED"}
    assert codes.get("OK", 0) >= FUZZ_REQUESTS // 3 // 6 and codes.get("INVALID_ARGUMENT", 0) >= FUZZ_REQUESTS // 3 // 6
    assert_still_serving_the_targets_output(channel, md, remote(server, tmp_path, protocol="stream"), local_target)


# ---- scale-out: replicas behind nginx


@pytest.fixture(scope="module")
def balanced(local_target, tmp_path_factory):
    """Two replicas (the module's target weights, a session table each) behind nginx with
    docs/nginx-replicas.conf, round robin: yields (nginx's port, the two services)."""
    import shutil
    from pathlib import Path
    from string import Template

    from omnidraft.rpc.server import serve

    nginx = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
    if nginx is None:
        pytest.skip("nginx is not installed (scripts/setup.sh installs Debian's package when it runs as root)")
    replicas = [serve(local_target, TARGET, "llamacpp", port=0, token=TOKEN) for _ in range(2)]
    prefix, port = tmp_path_factory.mktemp("nginx"), _free_port()
    conf = Template((Path(__file__).parents[1] / "docs" / "nginx-replicas.conf").read_text()).substitute(
        listen=f"127.0.0.1:{port}", prefix=prefix, replicas=" ".join(f"server 127.0.0.1:{r.port};" for r in replicas))
    (prefix / "nginx.conf").write_text(conf)
    proc = subprocess.Popen([nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"nginx did not start: {proc.stdout.read() if proc.poll() is not None else ''}")
                time.sleep(0.1)
        yield port, [r.service for r in replicas]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for r in replicas:
            r.drain(grace=1)


@pytest.mark.real
@pytest.mark.parametrize("protocol", ["stream", "verify"])
def test_a_client_whose_calls_move_between_replicas_stays_exact(balanced, local_target, real_models, tmp_path, protocol):
    """Through nginx every call may reach the other replica, which does not know the session: the
    output is still the target's own, and both replicas did the work."""
    from omnidraft.rpc.client import RemoteTarget

    port, services = balanced
    work = [s.batcher.forwards for s in services]
    client = RemoteTarget(f"grpc://127.0.0.1:{port}", token=TOKEN, home=tmp_path, protocol=protocol)
    through, alone = decoder_for(client, real_models), SpeculativeDecoder(local_target)
    config = DecodeConfig(**FORCED) if protocol == "verify" else DecodeConfig(max_new_tokens=16)
    for text, chat in PROMPTS:
        ids = encode_prompt(local_target.tokenizer, text, chat=chat)
        expected = alone.generate(ids, config).token_ids
        for _ in range(2):  # the second time the session is known to one replica only
            assert through.generate(ids, config).token_ids == expected
    assert all(s.batcher.forwards > w for s, w in zip(services, work))  # round robin reached both
    client.close()


# ---- the CLI: a server process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int, *args: str) -> subprocess.Popen:
    env = dict(os.environ, OMNIDRAFT_HOME=str(TEST_HOME), OMNIDRAFT_TOKEN=TOKEN)
    proc = subprocess.Popen([sys.executable, "-m", "omnidraft", "serve", "--port", str(port), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise AssertionError(proc.stderr.read())
            time.sleep(0.2)
    raise AssertionError("the server did not start")


def _client_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMNIDRAFT_HOME=str(TEST_HOME), OMNIDRAFT_TOKEN=TOKEN)
    return subprocess.run([sys.executable, "-m", "omnidraft", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.real
def test_cli_serve_generate_sigkill_restart_and_sigterm_drain(tmp_path):
    port = _free_port()
    server = _serve(port)
    url = f"grpc://127.0.0.1:{port}"
    try:
        args = ["generate", "--target", url, "--prompt", "def fib(n):\n", "--max-new-tokens", "24", "--json"]
        first = _client_cli(*args)
        assert first.returncode == 0, first.stderr
        local = _client_cli("generate", "--prompt", "def fib(n):\n", "--max-new-tokens", "24", "--json", "--drafter", "none")
        assert json.loads(first.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]

        # SIGKILL mid-generation, a new server on the same port: the client resends and finishes the same
        slow = subprocess.Popen([sys.executable, "-m", "omnidraft", *args[:-3], "--max-new-tokens", "96", "--json",
                                 "--draft-stop", "fixed", "--draft-len", "2"],
                                env=dict(os.environ, OMNIDRAFT_HOME=str(TEST_HOME), OMNIDRAFT_TOKEN=TOKEN),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(8)
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        server = _serve(port)
        out, err = slow.communicate(timeout=600)
        if slow.returncode == 0:
            expected = _client_cli("generate", "--prompt", "def fib(n):\n", "--max-new-tokens", "96", "--json",
                                   "--drafter", "none")
            assert json.loads(out)["token_ids"] == json.loads(expected.stdout)["token_ids"]
        else:  # the retry budget ran out first: one clear line
            lines = [ln for ln in err.splitlines() if ln.startswith("omnidraft: error:")]
            assert slow.returncode == 2 and len(lines) == 1 and "Traceback" not in err, err

        # SIGTERM drains: the server exits 0 and says so
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0 and "drained" in server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.real
def test_cli_serve_batch_serves_concurrent_clients_each_as_alone(tmp_path):
    """`serve --batch` on the CPU (the unpadded session pool, the real 0.5B): two clients at once get
    what each gets alone, and the server's counters show forwards they shared."""
    import threading

    from omnidraft.rpc.client import RemoteTarget

    port = _free_port()
    server = _serve(port, "--batch", "--max-sessions", "2")
    try:
        clients = [RemoteTarget(f"grpc://127.0.0.1:{port}", token=TOKEN, home=tmp_path) for _ in range(2)]
        decoders = [SpeculativeDecoder(c) for c in clients]  # thin clients: Generate streams
        tok = clients[0].tokenizer
        prompts = [encode_prompt(tok, "def is_prime(n):\n"), encode_prompt(tok, "Name three sorting algorithms.", chat=True)]
        config = DecodeConfig(max_new_tokens=12)
        alone = [d.generate(ids, config).token_ids for d, ids in zip(decoders, prompts)]
        info = clients[0].server_info()
        assert info.batch_sessions == 2 and info.engine == "torch"
        for c in clients:
            c.new_session()  # each prompt is read afresh, as it was alone
        together: list = [None, None]
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, decoders[i].generate(prompts[i], config).token_ids))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert together == alone
        after = clients[0].server_info()
        assert after.forwards - info.forwards < after.emitted - info.emitted  # some forwards served both
        for c in clients:
            c.close()
    finally:
        server.kill()


def test_a_public_address_without_a_token_is_refused():
    from test_cli import assert_one_line_error

    env = dict(os.environ, OMNIDRAFT_HOME=str(TEST_HOME))
    env.pop("OMNIDRAFT_TOKEN", None)
    proc = subprocess.run([sys.executable, "-m", "omnidraft", "serve", "--host", "0.0.0.0", "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc, "without a token or TLS")


@pytest.mark.real
def test_adapt_against_a_remote_target_produces_an_adapter(server, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(TEST_HOME / "models", target_is_directory=True)
    env = dict(os.environ, OMNIDRAFT_HOME=str(home), OMNIDRAFT_TOKEN=TOKEN)
    proc = subprocess.run([sys.executable, "-m", "omnidraft", "adapt", "--target", f"grpc://127.0.0.1:{server.port}",
                           "--stream", "humaneval", "--n", "2", "--interval", "2", "--max-new-tokens", "16", "--json"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert summary["updates"] == 1 and summary["trainer_errors"] == [] and summary["adapter"]
