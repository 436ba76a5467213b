"""Forks of a streamed draft: the device's drafts for the corrections the server may make.

Over a ``Decode`` stream the device drafts its line ahead of the server and, in the time it would
otherwise wait, forks it where its drafter noted a runner-up. These tests hold the two halves of the
mechanism to their contracts without a model: the server's ``Drafts`` takes the longest path that
continues what it emitted (a fork after a correction), and the device's ``Device`` follows what the
server emitted onto the fork that foresaw it. The real pair over a real server is in test_rpc.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omnidraft.drafter.base import Draft
from omnidraft.rpc.server import MAX_FORKS, Drafts
from omnidraft.rpc.streaming import AHEAD, Device, _Fork, _Seed
from omnidraft.verify.proposal import Proposal

VOCAB, LIMIT = 100, 1000


def test_the_server_verifies_the_fork_that_continues_a_correction():
    drafts = Drafts(VOCAB, LIMIT)
    drafts.put(10, [1, 2, 3, 4], [(11, [7, 8, 9]), (12, [5, 6])])
    assert drafts.usable([0] * 10, 8) == ([1, 2, 3, 4], False)  # nothing emitted meanwhile: the line
    assert drafts.usable([0] * 10 + [1, 7], 8) == ([8, 9], True)  # corrected at 11 as the first fork foresaw
    assert drafts.usable([0] * 10 + [1, 7, 8, 6], 8) == ([], False)  # past what any path foresaw
    drafts.put(12, [1, 2], [(12, [1, 3, 4])])
    assert drafts.usable([0] * 12, 1) == ([1], True)  # the longer path, cut to k
    drafts.put(12, [1, 2, 3], [(12, [1, 3, 4])])
    assert drafts.usable([0] * 12, 8) == ([1, 2, 3], False)  # as long as the line: the line


@pytest.mark.parametrize("forks, error", [
    ([(9, [1])], "within its draft"), ([(15, [1])], "within its draft"), ([(10, [])], "within its draft"),
    ([(10, [VOCAB])], "token ids"), ([(12, [1] * LIMIT)], "context"), ([(10, [1])] * (MAX_FORKS + 1), "at most"),
])
def test_a_bad_fork_ends_the_stream_with_the_reason(forks, error):
    drafts = Drafts(VOCAB, LIMIT)
    drafts.put(10, [1, 2, 3, 4], forks)
    assert drafts.error is not None and error in drafts.error


def device(text: list[int], ahead: list[int], k_max: int = 4) -> Device:
    """A device thread, not started: what it does with the server's messages is plain bookkeeping."""
    request = SimpleNamespace(k_max=k_max, sources=[], room=lambda text, ahead: 64, eos_ids=frozenset({99}))
    d = Device(request, text, send=lambda *message: None)
    d.ahead = list(ahead)
    return d


def fork(at: int, tokens: list[int], base: int, drafted: int) -> _Fork:
    """A fork at context position ``at`` of a chunk drafted after ``base``, ``drafted`` drafter tokens deep,
    with a runner-up noted at each drafted position past the fork's own."""
    path = Draft(list(range(drafted)), None, runners_up=[-1] + [5] * (drafted - 1))
    return _Fork(at, tokens, _Seed(base, Proposal([]), 0, source=None), Proposal(list(tokens), path))


def test_the_device_takes_the_fork_that_foresaw_a_correction():
    d = device([0] * 10, [1, 2, 3, 4])
    d.forks = [fork(11, [7, 8, 9], base=10, drafted=4), fork(11, [6, 5], base=10, drafted=3)]
    assert d._follow(10, [1, 7]) is True  # the sources begin again on the fork's text
    assert d.text == [0] * 10 + [1, 7] and d.ahead == [8, 9] and d.forks_taken == 1
    assert not d.forks and [s.index for s in d.seeds] == [1, 2, 3]  # it may fork again past the runner-up


def test_a_correction_no_fork_foresaw_drops_the_line():
    d = device([0] * 10, [1, 2, 3, 4])
    d.forks = [fork(11, [7, 8, 9], base=10, drafted=4)]
    assert d._follow(10, [1, 6]) is True
    assert d.ahead == [] and not d.forks and not d.seeds and d.forks_taken == 0


def test_forks_the_text_went_past_are_dropped():
    d = device([0] * 10, [1, 2, 3, 4])
    d.forks = [fork(10, [7, 8], base=10, drafted=3), fork(12, [9, 9], base=10, drafted=3)]
    assert d._follow(10, [1, 2]) is False  # the line was right: no rewind
    assert d.ahead == [3, 4] and [f.at for f in d.forks] == [12]  # the fork at 10 can no longer be taken


def test_the_device_forks_only_while_the_server_says_forks_may_pay_and_drafts_no_line_past_the_end():
    d = device([0] * 10, [1, 2, 3])
    seed = _Seed(10, Proposal([1, 2, 3], Draft([1, 2, 3], None, runners_up=[4, 5, 6])), 0, source=None)
    d.seeds = [seed]
    assert d._fork_work() is seed and d._line_due(idle=False)
    d.forks_resting = True  # an Emitted with rest_forks: the server's budget for forks verifies none now
    assert d._fork_work() is None
    d.ahead += [99]
    assert not d._line_due(idle=False)  # the line ends at the end of sequence


def test_a_line_that_drafts_nothing_more_is_drafted_again_once_per_text():
    d = device([0] * 10, [1, 2, 3])
    assert d._retry() and d.ahead == []  # once: begin again from the emitted text
    d.ahead = [1, 2, 3]  # the same line drafted again, and again nothing after it
    assert not d._retry() and d.ahead == [1, 2, 3]  # kept, and the device waits for the server
    d._follow(10, [1])  # news: the server kept a token
    d.ahead.append(4)
    assert d._retry() and d.ahead == []  # a new text: one more try
    assert not device([0] * 10, [])._retry()  # nothing drafted on the emitted text itself: wait for more of it


def test_the_device_drafts_no_further_ahead_than_the_server_would_verify():
    """Where the server verifies one token a forward, a line drafted ``k_max`` ahead is mostly thrown
    away at the next correction: the device stops at what the server said it would verify plus its lead."""
    d = device([0] * 10, list(range(1, 13)), k_max=8)
    assert d.limit == 8 + AHEAD and d._line_due(idle=False)  # nothing said yet: all it may
    assert d._hear(10, [1], rest=False, rest_forks=False, verify_k=1) is False
    assert d.limit == 1 + AHEAD and len(d.ahead) == 11 and not d._line_due(idle=False)
    d._hear(11, [2], rest=False, rest_forks=False, verify_k=0)  # a server that does not say: k_max
    assert d.limit == 8 + AHEAD and d._line_due(idle=False)
    for position, nonsense in ((12, 50), (13, -3)):  # never past k_max, never under nothing
        d._hear(position, [3 + position - 12], rest=False, rest_forks=False, verify_k=nonsense)
        assert d.limit == 8 + AHEAD
