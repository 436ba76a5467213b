"""The streaming device against a server faster than its drafter (a GPU server, a CPU drafter).

There the drafter never has a token ahead of the server, and before these rules it still read each
prompt whole: a 64-token answer from a GPU server ended before the read did, and the request waited
for it (0.3x the server streaming alone). These tests hold the two rules to their contracts without
a model or a server: the device drafts nothing with its model while the drafter is slower per token
than the server per forward (``Pace``), and it reads a long context a piece at a time, so that a
stream that ends waits for one piece. The real pair over a real server is in test_rpc.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from omnidraft.config import DecodeConfig
from omnidraft.drafter.base import Draft
from omnidraft.rpc.streaming import Device, Pace, StreamRequest
from omnidraft.sources.base import Offer
from omnidraft.verify.proposal import Proposal


def test_the_pace_says_too_slow_only_when_the_drafter_is_slower_than_a_forward():
    pace = Pace()
    assert not pace.too_slow  # nothing measured: the device drafts, and so learns its drafter's pace
    pace.drafted(0.010, 2)  # 5 ms per token
    pace.begin()
    pace.heard(0.0)
    assert not pace.too_slow  # one message: its gap from the request is the prompt read, no forward's
    for i in range(1, 20):
        pace.heard(0.003 * i)  # a forward every 3 ms
    assert pace.too_slow and abs(pace.forward_s - 0.003) < 1e-9
    pace.begin()  # a new stream: the gap to its first message is not a forward
    pace.heard(10.0)
    assert abs(pace.forward_s - 0.003) < 1e-9
    for i in range(1, 40):
        pace.heard(10.0 + 0.02 * i)  # the server slowed down (more sessions per forward)
    assert not pace.too_slow


class Source:
    """A draft source that records what it was asked; ``left`` drafter tokens of context it would
    still read (each read takes ``read_s`` and leaves it as it was when ``forever``)."""

    def __init__(self, name: str, free: bool, left: int = 0, forever: bool = False, read_s: float = 0.0) -> None:
        self.name, self.free, self.left, self.forever, self.read_s = name, free, left, forever, read_s
        self.drafts = self.reads = 0

    def offer(self, ids, room):
        return Offer(self.name, 4)

    def read(self, ids, k, limit):
        self.reads += 1
        time.sleep(self.read_s)
        if not self.forever:
            self.left = max(self.left - limit, 0)
        return self.left

    def draft(self, ids, offer, k, times):
        self.drafts += 1
        return Proposal([7] * k, Draft([7] * k, None))

    def accept(self, step):
        pass

    def begin(self, ids, config, policy):
        return True


def device(sources: list, pace: Pace, sent: list) -> Device:
    request = SimpleNamespace(k_max=4, sources=sources, room=lambda text, ahead: 64, eos_ids=frozenset({99}),
                              pace=pace, between=lambda: None, config=None, policy=None)
    return Device(request, [1, 2, 3], send=lambda position, tokens, forks: sent.append((position, tokens)))


def slow_pace() -> Pace:
    pace = Pace()
    pace.drafted(0.02, 1)
    for i in range(5):
        pace.heard(0.003 * i)
    return pace


def test_a_drafter_slower_than_the_server_drafts_nothing_and_a_free_source_still_does():
    model, sent = Source("drafter", free=False), []
    d = device([model], slow_pace(), sent)
    assert not d._draft() and model.drafts == model.reads == 0 and sent == []  # not even the prompt read
    lookup = Source("lookup", free=True)
    d = device([model, lookup], slow_pace(), sent)
    assert d._draft() and lookup.drafts == 1 and model.drafts == 0 and sent == [(3, [7] * 4)]


def test_a_long_context_is_read_a_piece_per_call_before_the_first_draft():
    model, sent = Source("drafter", free=False, left=100), []
    d = device([model], Pace(), sent)
    for _ in range(3):  # 100 tokens, 32 per piece: three pieces leave 4 for the draft's own read
        assert d._draft() and model.drafts == 0 and sent == []
    assert d._draft() and model.drafts == 1 and sent == [(3, [7, 7])]  # a chunk of CHUNK tokens


def test_a_stream_that_ends_during_a_long_read_waits_for_one_piece():
    model = Source("drafter", free=False, left=10_000, forever=True, read_s=0.01)  # a read that never ends
    d = device([model], Pace(), [])
    d.start()
    while model.reads < 3:
        time.sleep(0.005)
    d.stop()
    d.join(timeout=10)
    assert not d.is_alive() and d.error is None and model.drafts == 0


def test_a_request_streams_drafts_up_only_where_the_device_has_something_the_server_lacks():
    remote = SimpleNamespace(max_draft=8, rtt_s=0.0, eos_ids=frozenset(), pace=slow_pace())
    drafter, context, history = (Source("drafter", free=False), Source("context", free=True),
                                 Source("history", free=True))

    def up(sources) -> bool:
        return StreamRequest(remote, sources, None, DecodeConfig(), None, lambda: None)._drafts_up()

    assert not up([context, drafter])  # the server looks up in the context itself; the drafter cannot keep up
    assert up([history, context, drafter])  # a lookup history the server does not hold
    assert not up([])
    remote.pace = Pace()
    assert up([context, drafter])  # a drafter not known to be slower than the server
