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

        def work(i: int) -> None:
            for _ in range(3):
                outputs[i] = decoders[i].generate(prompts[i], config).token_ids

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert outputs == alone
        messages = sum(d.stats.target_forwards for d in decoders)  # forwards each session took part in
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

        def score_many(self, requests):
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
