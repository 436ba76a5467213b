"""Any temperature gives finite draws from the target's distribution (issue 29 #2: at 1e-45 the logits
divided by the temperature overflowed and every draw was the last id). Below MIN_TEMPERATURE the
CLI and the server refuse in one line; the sampling function itself treats it as the greedy limit.
"""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import tiny_pair

from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.verify import MIN_TEMPERATURE, MIN_TEMPERATURE_F32
from omnidraft.verify.sampling import draw, probs_from_logits

EDGE_TEMPERATURES = [5e-324, 1e-320, 1e-310, 2.2250738585072014e-308, 1e-45, 1.4e-45, 1e-30, 9.99e-5, MIN_TEMPERATURE,
                     1e-3, 0.7, 1.0, 100.0, 1e30, 1e300, 1.7976931348623157e308, math.inf]
temperatures = st.one_of(st.sampled_from(EDGE_TEMPERATURES),
                         st.floats(min_value=0.0, max_value=1e308, allow_subnormal=True, exclude_min=True))
logit_rows = st.lists(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32), min_size=2, max_size=64)


def _reference(logits: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(logits / T) in float64 with the max shifted out; the argmax one-hot below the minimum."""
    if temperature < MIN_TEMPERATURE_F32:
        out = np.zeros(len(logits))
        out[int(np.argmax(logits))] = 1.0
        return out
    with np.errstate(invalid="ignore"):  # -inf / inf in the branch np.where does not take
        z = np.where(np.isneginf(logits), -np.inf, (logits - logits.max()) / temperature)
    e = np.exp(z)
    return e / e.sum()


@settings(max_examples=300, deadline=None)
@given(row=logit_rows, temperature=temperatures, masked=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_any_temperature_gives_finite_draws_from_the_targets_distribution(row, temperature, masked, seed):
    logits = torch.tensor(row, dtype=torch.float32)
    if masked:  # the tail ids masked out, the last one among them (at least one id stays)
        logits[-min(masked, len(row) - 1):] = -math.inf
    probs = probs_from_logits(logits, temperature)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert abs(float(probs.sum()) - 1.0) < 1e-5
    reference = _reference(logits.double().numpy(), temperature)
    assert np.abs(probs.double().numpy() - reference).max() < 1e-4
    generator = torch.Generator().manual_seed(seed)
    for _ in range(3):
        token = draw(probs, generator)
        assert 0 <= token < len(row) and float(probs[token]) > 0  # never an id of probability 0, such as a masked last one
        if temperature < MIN_TEMPERATURE_F32:
            assert token == int(logits.argmax())


def test_a_row_with_no_finite_mass_is_an_error_not_the_last_id():
    for row in (torch.full((5,), math.nan), torch.zeros(5), torch.tensor([0.0, math.inf, 1.0])):
        with pytest.raises(ValueError, match="total mass"):
            draw(row)


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-310])
def test_a_subnormal_temperature_decodes_the_greedy_output(temperature):
    """Through the whole loop (target sampling, and speculative sampling with the tiny drafter), the
    greedy limit: the target's argmax tokens, not a run of the last id."""
    from omnidraft.runtime import make_drafter

    d_model, target, bridge = tiny_pair()
    prompt = target.tokenizer.encode("the cat sat on")
    greedy = SpeculativeDecoder(target).generate(prompt, DecodeConfig(max_new_tokens=16)).token_ids
    config = DecodeConfig(max_new_tokens=16, temperature=temperature, verify="text-sample")
    config.validate()  # a library caller may pass it: the sampling treats it as greedy
    alone = SpeculativeDecoder(target).generate(prompt, config).token_ids
    drafted = SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge).generate(prompt, config).token_ids
    assert alone == greedy and drafted == greedy
    assert alone.count(target.vocab_size - 1) < len(alone)


def test_serve_refuses_a_temperature_below_the_minimum_in_one_line():
    from omnidraft.rpc.proto import pb, services
    from omnidraft.rpc.server import serve

    _, target, _ = tiny_pair()
    served = serve(target, "tiny", "torch", port=0)
    try:
        stub = services.TargetStub(grpc.insecure_channel(f"127.0.0.1:{served.port}"))
        ids = target.tokenizer.encode("the cat sat")
        for temperature in (1e-45, 1e-30, 9e-5):  # 1e-4 itself arrives as float32 9.9999997e-05: accepted
            with pytest.raises(grpc.RpcError) as err:
                stub.Verify(pb.VerifyRequest(session_id="s", append=ids, rule="text-sample", temperature=temperature),
                            timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "too small" in err.value.details() and "\n" not in err.value.details()
        reply = stub.Verify(pb.VerifyRequest(session_id="s", append=ids, rule="text-sample", temperature=MIN_TEMPERATURE),
                            timeout=30)
        assert 0 <= reply.next_token < target.vocab_size
    finally:
        served.drain(grace=1)


@pytest.mark.parametrize("words", [["bench"], ["experiment", "cache"], ["experiment", "sampling"]])
def test_the_bench_and_experiment_sample_temperatures_refuse_a_tiny_temperature_in_one_line(words, capsys):
    """`--sample-temperature` of bench and the experiments takes the CLI's temperature type: no zero
    (they sample), and nothing in (0, MIN_TEMPERATURE) either. Argument errors exit before anything loads."""
    from omnidraft.cli import main

    for value, needle in (("1e-45", "too small a temperature"), ("5e-5", "too small a temperature"), ("0", "out of range")):
        with pytest.raises(SystemExit) as exit_:
            main([*words, "--sample-temperature", value])
        assert exit_.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("omnidraft: error: "), lines
        assert "--sample-temperature" in lines[0] and needle in lines[0], lines[0]
