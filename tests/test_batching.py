"""A server that batches: sessions of the static engine share one KV tensor (a ``SessionPool``) and
every decode forward serves all of them. A session's logits are the same bits whether it was read
alone or with others, so every client's output through a batching server equals its output alone;
and concurrent streams do share forwards. The GPU run is measured in docs/remote.md; here the same
code runs on the CPU (no graphs) on tiny random models."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.errors import OmnidraftError
from omnidraft.runtime import load_target, make_drafter
from omnidraft.target import TorchTarget
from omnidraft.target import static
from tests.tiny import tiny_pair

TOKEN = "batching-test-token"


@pytest.fixture(scope="module")
def qwen():
    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return Qwen2ForCausalLM(config).eval()


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(1, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("padded", [True, False], ids=["gpu-classes", "cpu-unpadded"])
def test_pooled_sessions_read_the_same_bits_together_as_alone(qwen, padded):
    pool = static.SessionPool(static.extract(qwen, "cpu", torch.float32), sessions=4, max_context=200, padded=padded)
    a, b, c = pool.session(), pool.session(), pool.session()
    prompts = [_ids(1, 30), _ids(2, 45), _ids(3, 20)]
    for lm, ids in zip((a, b, c), prompts):
        lm.logits_for(ids, 1)
    # one forward's mixed work: a plain step, a verify of 5 proposals, a verify of 20 (two padded forwards)
    work = [(a, prompts[0] + [7], 1), (b, prompts[1] + [8, 9, 10, 11, 12, 13], 6), (c, prompts[2] + _ids(4, 21), 21)]
    together = static.logits_together(work)
    for (lm, ids, keep), rows in zip(work, together):
        lm.crop(len(ids) - keep)  # as before the shared forward
        assert torch.equal(lm.logits_for(ids, keep), rows)
    with torch.no_grad():  # and they are the model's logits
        for (_, ids, keep), rows in zip(work, together):
            assert torch.allclose(rows, qwen(torch.tensor([ids])).logits[0, -keep:], atol=1e-4)


def test_smaller_classes_are_allowed_only_where_they_give_the_full_class_bits(qwen):
    pool = static.SessionPool(static.extract(qwen, "cpu", torch.float32), sessions=4, max_context=200)
    assert pool.classes == [4]  # unchecked: every decode forward is the full class
    pool.warm_up(16)
    assert pool.classes[-1] == 4 and set(pool.classes) <= {1, 2, 4}
    lm = pool.session()
    assert lm.slot == 0  # the lowest free slot: a lone session fits the smallest class
    lm.logits_for(_ids(5, 30), 1)
    steps = {}
    for size in (1, 2, 4):  # the same verify read in a forward of each size
        lm.crop(30)
        steps[size] = pool._decoder(size).run_many({0: (_ids(6, 9), 30)})[0].clone()
    for size in pool.classes:
        assert torch.equal(steps[size], steps[4])
    for size in {1, 2} - set(pool.classes):
        assert not torch.equal(steps[size], steps[4])  # refused because it differed


def test_a_full_pool_refuses_a_session_until_one_is_dropped(qwen):
    pool = static.SessionPool(static.extract(qwen, "cpu", torch.float32), sessions=2, max_context=64)
    first, second = pool.session(), pool.session()
    assert {first.slot, second.slot} == {0, 1}
    with pytest.raises(RuntimeError, match="in use"):
        pool.session()
    del first
    assert pool.session().slot in (0, 1)
    with pytest.raises(ValueError, match="one pool"):
        static.logits_together([(second, [1, 2], 1), (static.StaticLM(pool.weights, 64), [1, 2], 1)])


def test_batching_is_refused_on_llama_cpp_in_one_line():
    with pytest.raises(OmnidraftError, match="--engine torch"):
        load_target("builtin:qwen2.5-coder-0.5b", "llamacpp", device="cpu", batch=4)


@pytest.mark.parametrize("padded", [True, False], ids=["gpu-classes", "cpu-unpadded"])
def test_concurrent_streams_share_forwards_and_each_output_is_its_own_alone(tmp_path, padded):
    from omnidraft.rpc.client import RemoteTarget
    from omnidraft.rpc.server import serve

    d_model, eager, bridge = tiny_pair()
    pool = static.SessionPool(static.extract(eager.model, "cpu", torch.float32), sessions=4, max_context=200, padded=padded)
    served = serve(TorchTarget(eager.model, eager.tokenizer, pool), "tiny", "torch", port=0, token=TOKEN, max_sessions=8)
    assert served.service.max_sessions == 4  # the pool's slots
    config = DecodeConfig(max_new_tokens=24, lookup=False)
    prompts = [eager.tokenizer.encode(t) for t in ("the cat sat on", "def add(a, b):", "numbers like 12", "the dog")]

    def decoder(drafting: bool) -> SpeculativeDecoder:
        target = RemoteTarget(f"grpc://127.0.0.1:{served.port}", token=TOKEN, home=tmp_path, protocol="stream")
        if not drafting:
            return SpeculativeDecoder(target)
        return SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge)

    try:
        modes = [False, True, False, True]  # Generate streams and Decode streams (drafts) side by side
        alone = []
        for prompt, drafting in zip(prompts, modes):
            d = decoder(drafting)
            alone.append(d.generate(prompt, config).token_ids)
            d.target.close()
        before = served.service.batcher.forwards
        decoders = [decoder(m) for m in modes]
        outputs: list[list[int] | None] = [None] * len(prompts)
        taken = [0] * len(prompts)  # forwards each session took part in, over its three requests

        def work(i: int) -> None:
            for _ in range(3):
                outputs[i] = decoders[i].generate(prompts[i], config).token_ids
                taken[i] += decoders[i].stats.target_forwards

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert outputs == alone
        messages = sum(taken)  # (stats are a request's: the last one's alone compared a third of the messages)
        shared = served.service.batcher.forwards - before
        assert shared < messages  # sessions went through forwards together
        info = decoders[0].target.server_info()
        assert info.batch_sessions == 4 and info.forwards >= shared and info.emitted > 0 and info.busy_s > 0
        for d in decoders:
            d.target.close()
    finally:
        served.drain(grace=1)


class _Slow:
    """An engine session whose forward takes a while and whose logits name the ids it read."""

    def score(self, ids, num_proposed):
        threading.Event().wait(0.01)
        return torch.tensor([[float(sum(ids))]])


@pytest.mark.parametrize("sessions", [1, 3])
def test_every_stream_gets_its_own_forward_when_many_wait(sessions):
    from omnidraft.rpc.server import Batcher

    class Engine:
        batch_sessions = sessions

        def score_many(self, requests, to_host=True):
            threading.Event().wait(0.01)
            return [t.score(ids, k) for t, ids, k in requests]

    batcher = Batcher(Engine(), threading.Lock())
    got: dict[int, list[float]] = {}

    def stream(i: int) -> None:
        batcher.join()
        try:
            got[i] = [float(batcher.score(_Slow(), [i, step], 0)[0][0, 0]) for step in range(6)]
        finally:
            batcher.leave()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {i: [float(i + step) for step in range(6)] for i in range(5)}
    assert batcher.forwards < 30 if sessions > 1 else batcher.forwards == 30  # shared forwards only where it batches


def test_hostile_calls_from_many_threads_leave_a_batching_server_up_and_exact(tmp_path):
    """A bounded fuzz of a batching server (two slots, a 200-token context) from four threads at once,
    so that hostile work lands in shared forwards: more sessions than slots, prefixes it does not
    hold, contexts over the limit, huge and bad drafts, streams cancelled midway, bytes that are no
    message. Only clear refusals come back, and a client still gets its output from before."""
    import random

    import grpc

    from omnidraft.rpc.client import RemoteTarget
    from omnidraft.rpc.proto import pb
    from omnidraft.rpc.server import serve

    _, eager, _ = tiny_pair()
    pool = static.SessionPool(static.extract(eager.model, "cpu", torch.float32), sessions=2, max_context=200, padded=False)
    served = serve(TorchTarget(eager.model, eager.tokenizer, pool), "tiny", "torch", port=0, token=TOKEN)
    config = DecodeConfig(max_new_tokens=16, lookup=False)
    prompt = eager.tokenizer.encode("the cat sat on")
    client = RemoteTarget(f"grpc://127.0.0.1:{served.port}", token=TOKEN, home=tmp_path)
    before = SpeculativeDecoder(client).generate(prompt, config).token_ids
    channel = grpc.insecure_channel(f"127.0.0.1:{served.port}")
    md = (("authorization", f"Bearer {TOKEN}"),)
    decode = channel.stream_stream("/omnidraft.v1.Target/Decode", request_serializer=lambda m: m if isinstance(m, bytes)
                                   else m.SerializeToString(), response_deserializer=pb.Emitted.FromString)
    verify = channel.unary_unary("/omnidraft.v1.Target/Verify", request_serializer=lambda m: m if isinstance(m, bytes)
                                 else m.SerializeToString(), response_deserializer=pb.VerifyReply.FromString)
    vocab, codes, lock = eager.vocab_size, {}, threading.Lock()

    def hostile(worker: int) -> None:
        rng = random.Random(worker)
        for i in range(40):
            sid = f"w{worker}-{rng.randrange(6)}"  # six ids per thread, two slots in all: evictions and refusals
            kind = i % 5
            try:
                if kind == 0:
                    verify(rng.randbytes(rng.randrange(1, 100)), timeout=30, metadata=md)
                elif kind == 1:
                    verify(pb.VerifyRequest(session_id=sid, prefix_len=rng.choice([0, 3, 10**6]),
                                            append=[rng.randrange(-2, vocab + 2) for _ in range(rng.choice([1, 5, 250]))],
                                            proposed=[rng.randrange(vocab) for _ in range(rng.choice([0, 4, 40]))],
                                            rule="greedy"), timeout=30, metadata=md)
                elif kind == 3:  # a well-formed stream with drafts, between the hostile ones
                    start = pb.GenerateRequest(session_id=f"ok{worker}-{i}", append=[rng.randrange(vocab) for _ in range(3)],
                                               max_new_tokens=8, max_proposals=4)
                    drafts = [pb.DecodeUp(draft=pb.Draft(start=3, tokens=[rng.randrange(vocab) for _ in range(4)]))]
                    for attempt in range(50):  # both slots may be decoding: retry, as a client does on UNAVAILABLE
                        try:
                            list(decode(iter([pb.DecodeUp(start=start), *drafts]), timeout=30, metadata=md))
                            break
                        except grpc.RpcError as exc:
                            if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == 49:
                                raise
                            threading.Event().wait(0.02)
                else:
                    start = pb.GenerateRequest(session_id=sid, append=[rng.randrange(vocab) for _ in range(rng.choice([3, 190]))],
                                               max_new_tokens=rng.choice([4, 30]), max_proposals=rng.choice([0, 4, 10**6]))
                    drafts = [pb.DecodeUp(draft=pb.Draft(start=rng.choice([3, 5, -1, 10**9]),
                                                         tokens=[rng.randrange(vocab + 3) for _ in range(rng.randrange(1, 8))]))
                              for _ in range(rng.randrange(0, 3))]
                    replies = decode(iter([pb.DecodeUp(start=start), *drafts]), timeout=30, metadata=md)
                    for _ in replies:
                        if kind == 4:
                            replies.cancel()
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            with lock:
                codes[code] = codes.get(code, 0) + 1

    threads = [threading.Thread(target=hostile, args=(w,)) for w in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(f"fuzz of a batching server: {sum(codes.values())} calls from 4 threads -> {codes}")
        assert set(codes) <= {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "CANCELLED",
                              "UNAVAILABLE", "ABORTED"}, codes
        assert codes.get("OK", 0) >= 10 and codes.get("INVALID_ARGUMENT", 0) >= 10, codes
        client.new_session()
        assert SpeculativeDecoder(client).generate(prompt, config).token_ids == before
        assert served.service.batcher.streams == 0  # every stream that ended left the gather count
    finally:
        channel.close()
        client.close()
        served.drain(grace=1)


def test_on_a_cpu_pool_each_session_is_charged_its_rows_share_of_a_shared_forward(qwen):
    from omnidraft.rpc.server import Batcher, _Job

    pool = static.SessionPool(static.extract(qwen, "cpu", torch.float32), sessions=2, max_context=200, padded=False)
    _, eager, _ = tiny_pair()
    target = TorchTarget(qwen, eager.tokenizer, pool)  # any tokenizer: only the ids matter here
    a, b = target.session(), target.session()
    a.score(_ids(1, 20), 0)
    b.score(_ids(2, 20), 0)
    batcher = Batcher(target, threading.Lock())
    step, verify = _Job(a, _ids(1, 20) + [5], 0), _Job(b, _ids(2, 20) + [6, 7, 8, 9], 3)  # 1 row and 4 rows
    batcher._run([step, verify])
    assert target.cost_by_rows and batcher.forwards == 1
    # one forward seen: no fit yet, so each pays its rows' share
    assert verify.seconds == pytest.approx(4 * step.seconds) and step.seconds + verify.seconds == pytest.approx(batcher.busy_s)
    gpu_like = TorchTarget(qwen, eager.tokenizer, static.SessionPool(pool.weights, sessions=2, max_context=200))
    assert not gpu_like.cost_by_rows  # a padded forward costs the same whatever a session reads: each pays all of it


@pytest.mark.parametrize("rule, temperature, logprobs_k, argmax_only", [
    ("greedy", 0.0, 0, True),
    ("greedy", 0.0, 4, False),  # the trainer's log-probs read whole rows
    ("text-sample", 0.7, 0, False),  # drawn with the host's per-position generators
    ("greedy", 0.7, 0, False),  # a plain step at a temperature samples, whatever the rule's name
])
def test_only_greedy_steps_without_log_probs_leave_a_batched_forwards_rows_on_its_device(rule, temperature, logprobs_k,
                                                                                         argmax_only):
    from types import SimpleNamespace

    from omnidraft.rpc.server import argmax_only as reads_argmax_only
    config = SimpleNamespace(verify=rule, temperature=temperature, top_p=1.0, seed=0)
    assert reads_argmax_only(config, logprobs_k) is argmax_only


def test_row_costs_charge_a_fixed_part_equally_and_each_row_at_its_fitted_price():
    """Where extra rows are nearly free (a one-pass kernel), a session's verify must not be charged a
    rows' share of the whole forward, nor a plain step more for falling in a half-empty forward, or
    the proposal budget stops verifying on a busy server."""
    from omnidraft.rpc.server import RowCosts

    costs = RowCosts()
    assert costs.split(1.0, [1, 3]) == pytest.approx([0.25, 0.75])  # nothing seen: the rows' share
    for sessions, rows in ((8, 8), (4, 12), (8, 16), (8, 24), (8, 8), (4, 16)):  # 100 ms fixed + 2 ms per row
        costs.observe(rows, 0.100 + 0.002 * rows, sessions)
    fixed, per_row = costs.fit()
    assert fixed == pytest.approx(0.100) and per_row == pytest.approx(0.002)
    usual = (8 * 0.98**5 + 4 * 0.98**4 + 8 * 0.98**3 + 8 * 0.98**2 + 8 * 0.98 + 4) / sum(0.98**i for i in range(6))
    full = costs.split(0.122, [1, 1, 1, 1, 1, 1, 5])  # six plain steps and a verify of 4
    assert full[-1] - full[0] == pytest.approx(4 * 0.002)  # the verify pays for its 4 extra rows only
    assert full[0] == pytest.approx(0.100 / usual + 0.002)
    assert costs.split(0.104, [1, 1])[0] == pytest.approx(full[0])  # a plain step costs the same in a half-empty forward
    cost = costs.verify_cost()  # what the proposal budget prices a verify of k at
    assert cost(4) - cost(0) == pytest.approx(4 * 0.002) and cost(0) == pytest.approx(full[0])
    flat = RowCosts()
    for rows in (8, 8, 8):
        flat.observe(rows, 0.1, 8)
    assert flat.fit() is None and flat.split(0.1, [1, 3]) == pytest.approx([0.025, 0.075])  # no spread: rows' share


def test_a_cpu_pools_budget_prices_verifies_by_the_fitted_rows_not_by_stale_charges():
    """A verify charged while one session ran (the whole forward) must not keep verifies priced at a
    full forward once eight sessions share each one: the budget then never verifies again."""
    from omnidraft.rpc.server import ProposalBudget, RowCosts

    costs = RowCosts()
    budget = ProposalBudget(costs)
    budget.observe(0, 0.100)
    budget.observe(1, 0.100)  # a verify timed when it had the forward to itself
    for _ in range(50):
        budget.observe(0, 0.0135)  # later: plain steps in forwards of eight sessions
    assert budget.best(0.7, 4) == 0  # from that table alone a verify looks 7x a plain step
    for sessions, rows in ((8, 8), (8, 9), (8, 12), (7, 7), (8, 10)):  # 100 ms fixed + 1 ms per row
        costs.observe(rows, 0.100 + 0.001 * rows, sessions)
    assert budget.best(0.7, 4) == 4  # priced by the fit: an extra row costs 1 ms against a ~13.5 ms plain step
