"""A session's streaming budgets carry over from one request to its next.

The server decides per stream how much of the device's draft to verify, from the session's
acceptance (``SessionBudget``). A fresh even prior each request made every request re-learn, with
verifies that lost, that a weak drafter does not pay; the session's ``StreamPlans`` keep what its
last request learned. Run over a real gRPC server on 127.0.0.1 with the tiny random pair.
"""

from __future__ import annotations

from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.rpc.client import RemoteTarget
from omnidraft.rpc.server import serve
from omnidraft.runtime import make_drafter
from tests.tiny import tiny_pair

TOKEN = "stream-plans-test-token"


def test_a_sessions_next_request_starts_from_what_its_last_one_learned(tmp_path):
    d_model, target, bridge = tiny_pair()
    served = serve(target, "tiny", "torch", port=0, token=TOKEN, max_sessions=4)
    config = DecodeConfig(max_new_tokens=16, lookup=False)

    def decoder() -> SpeculativeDecoder:
        remote = RemoteTarget(f"grpc://127.0.0.1:{served.port}", token=TOKEN, home=tmp_path, protocol="stream")
        return SpeculativeDecoder(remote, make_drafter(d_model, bridge, remote), bridge)

    try:
        first, other = decoder(), decoder()
        prompt = target.tokenizer.encode("the cat sat on")
        first.generate(prompt, config)
        plans = served.service.sessions[first.target.session_id].plans
        assert plans is not None
        forwards = plans.line.acceptance.steps + plans.line.exploration.steps
        assert forwards > 0
        first.generate(target.tokenizer.encode("def add(a, b):"), config)
        assert served.service.sessions[first.target.session_id].plans is plans  # the same budgets, not fresh ones
        assert plans.line.acceptance.steps + plans.line.exploration.steps > forwards  # and they went on counting
        other.generate(prompt, config)
        assert served.service.sessions[other.target.session_id].plans is not plans  # another device starts afresh
        for d in (first, other):
            d.target.close()
    finally:
        served.drain(grace=1)
