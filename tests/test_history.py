"""The lookup history on hand-made token lists: proposals (longest order first, overlaps, outputs
cut short), persistence across instances and processes, the LRU cap in memory and on disk, bad
files set aside, a writer killed mid-save, the decoder drafting from it without changing its
output, and ``omnidraft cache stats | clear`` touching only what omnidraft wrote."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from omnidraft.cli import main
from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.costs import EVEN_PRIOR
from omnidraft.sources.history import ORDERS, HistoryLookup, LookupHistory
from omnidraft.sources.lookup import LONG_MATCH, LONG_MATCH_PRIOR
from omnidraft.ngram.files import history_path, initialize_store

FP = "a" * 64  # vocabulary fingerprints (sha256 hex)
OTHER_FP = "b" * 64

# Children import the history without omnidraft.sources' __init__ (which loads torch), so a child
# starts in a fraction of a second; the module itself needs no torch.
CHILD = f"""
import sys, types
from pathlib import Path
import omnidraft
pkg = types.ModuleType("omnidraft.sources")
pkg.__path__ = [str(Path(omnidraft.__file__).parent / "sources")]
sys.modules["omnidraft.sources"] = pkg
from omnidraft.sources.history import LookupHistory
FP = {FP!r}
"""


def history(tmp_path: Path, name: str = "h.sqlite3", fp: str = FP, **kw) -> LookupHistory:
    return LookupHistory(tmp_path / name, fp, **kw)


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD + code, *args], check=False, capture_output=True, text=True, timeout=60)


def disk_keys(path: Path) -> list[str]:
    con = sqlite3.connect(str(path))
    try:
        return [k for (k,) in con.execute("SELECT key FROM history")]
    finally:
        con.close()


# ---------------------------------------------------------------- proposals


def test_proposes_what_followed_last_time(tmp_path):
    h = history(tmp_path)
    h.record([1, 2, 3, 4, 5, 6, 7, 8])
    assert h.propose([9, 9, 1, 2, 3, 4], 3) == [5, 6, 7]
    assert h.propose([1, 2, 3, 4], 16) == [5, 6, 7, 8]  # no more than was recorded
    assert h.propose([0, 2, 3, 4], 2) == [5, 6]  # the 3-gram when the 4-gram was never seen
    assert h.propose([4, 5, 6, 7], 0) == []
    assert h.propose([9, 9, 9, 9], 4) == [] and h.propose([3, 4], 4) == []  # unseen; shorter than any order


def test_a_long_history_match_is_a_copy_and_starts_from_the_long_match_prior(tmp_path):
    """A repeated request matches the earlier output's last 8 ids: that offer is keyed apart and starts
    from the long-match prior, as prompt lookup's copies do (on llama.cpp an even prior held a copy to
    3 proposals a step, and on torch it lost to the drafter before it was ever tried); a 4-gram alone
    starts even."""
    h = history(tmp_path)
    text = list(range(100, 140))
    h.record(text)
    source = HistoryLookup(None, h)  # offer reads the history only
    long = source.offer(text[:20], 16)
    assert (long.key, long.prior, long.ids) == (f"history-{LONG_MATCH}", LONG_MATCH_PRIOR, text[20:36])
    short = source.offer([7, 7, 7, 7] + text[10:14], 16)  # the last 8 ids were never seen; the last 4 were
    assert (short.key, short.prior, short.ids) == ("history-4", EVEN_PRIOR, text[14:30])


def test_the_longest_order_wins_over_a_more_recent_shorter_match(tmp_path):
    h = history(tmp_path)
    h.record([1, 2, 3, 4, 10, 11])
    h.record([7, 2, 3, 4, 20, 21])  # (2, 3, 4) is now followed by 20, 21; (1, 2, 3, 4) still by 10, 11
    assert h.propose([1, 2, 3, 4], 2) == [10, 11]
    assert h.propose([8, 2, 3, 4], 2) == [20, 21]


def test_overlapping_and_periodic_text(tmp_path):
    h = history(tmp_path)
    h.record([1, 2, 1, 2, 1, 2, 3])  # (1, 2, 1, 2) ends at 4 and at 6: the later one counts
    assert h.propose([1, 2, 1, 2], 5) == [3]
    assert h.propose([2, 1, 2, 1], 5) == [2, 3]
    h.record([5, 5, 5, 5, 5, 6])  # (5, 5, 5, 5) ends at 4 (then 5, 6) and at 5 (then 6)
    assert h.propose([5, 5, 5, 5], 4) == [6] and h.propose([0, 5, 5, 5], 4) == [6]


def test_an_output_cut_short_keeps_the_longer_continuation(tmp_path):
    h = history(tmp_path)
    h.record([1, 2, 3, 4, 5, 6, 7, 8])
    h.record([1, 2, 3, 4, 5])  # the same text, stopped earlier: nothing new
    assert h.propose([1, 2, 3, 4], 8) == [5, 6, 7, 8]
    h.record([1, 2, 3, 4, 9])  # a different continuation replaces it
    assert h.propose([1, 2, 3, 4], 8) == [9]


def test_continuations_are_at_most_16_ids(tmp_path):
    h = history(tmp_path)
    h.record(list(range(100, 140)))
    assert h.propose([100, 101, 102, 103], 50) == list(range(104, 120))


# ---------------------------------------------------------------- persistence


def test_round_trip_across_instances(tmp_path):
    first = history(tmp_path)
    first.record([1, 2, 3, 4, 5, 6, 7])
    assert first.propose([1, 2, 3, 4], 2) == [5, 6]  # one hit
    assert first.save() and first.pending == 0
    second = history(tmp_path)
    assert len(second) == len(first) == 7  # 3-grams ending at 3..6 and 4-grams ending at 4..6
    assert second.propose([1, 2, 3, 4], 3) == [5, 6, 7]
    assert second.entry([2, 3, 4, 5])[0] == [6, 7]
    assert second.entry([1, 2, 3, 4])[2] == 2  # the hit survived, plus this one
    assert second.problem is None and second.skipped_rows == 0


def test_two_processes_share_one_file(tmp_path):
    path = tmp_path / "h.sqlite3"
    parent = LookupHistory(path, FP)
    parent.record([1, 2, 3, 4, 5, 6])
    assert parent.save()
    child = run_child("import json\n"
                      "h = LookupHistory(sys.argv[1], FP)\n"
                      "print(json.dumps(h.propose([1, 2, 3, 4], 4)))\n"
                      "h.record([11, 12, 13, 14, 15, 16])\n"
                      "assert h.save()\n"
                      "print(len(h))\n", str(path))
    assert child.returncode == 0, child.stderr
    seen, count = child.stdout.splitlines()
    assert json.loads(seen) == [5, 6] and int(count) == 10  # the child read what the parent wrote
    parent.record([21, 22, 23, 24, 25])  # written after the child's save: only our changes go to disk
    assert parent.save()
    merged = LookupHistory(path, FP)
    assert merged.propose([1, 2, 3, 4], 2) == [5, 6]
    assert merged.propose([11, 12, 13, 14], 2) == [15, 16]  # the child's entries were not clobbered
    assert merged.propose([21, 22, 23, 24], 2) == [25]
    assert len(merged) == 13


# ---------------------------------------------------------------- the cap


def test_the_cap_evicts_the_least_recently_used(tmp_path):
    h = history(tmp_path, max_entries=10)
    h.record([1, 2, 3, 4, 5])  # 3 entries: (1,2,3), (2,3,4), (1,2,3,4)
    h.record([11, 12, 13, 14, 15])
    assert h.propose([1, 2, 3, 4], 1) == [5]  # used: now the most recent of the first three
    h.record([21, 22, 23, 24, 25])
    h.record([31, 32, 33, 34, 35])  # 12 entries: the two least recently used go
    assert len(h) == 10 and h.evictions == 2
    assert h.entry([1, 2, 3]) is None and h.entry([2, 3, 4]) is None
    assert h.entry([1, 2, 3, 4]) is not None and h.entry([11, 12, 13]) is not None
    assert h.save()
    assert len(disk_keys(tmp_path / "h.sqlite3")) == 10
    again = history(tmp_path, max_entries=10)
    assert again.entry([1, 2, 3, 4]) is not None and again.entry([1, 2, 3]) is None
    smaller = history(tmp_path, max_entries=4)  # a smaller cap than the file was written with
    assert len(smaller) == 4 and smaller.entry([31, 32, 33, 34]) is not None  # the newest stay
    assert smaller.entry([1, 2, 3, 4]) is None
    assert smaller.save() and len(disk_keys(tmp_path / "h.sqlite3")) == 4


def test_many_records_stay_within_the_cap(tmp_path):
    h = history(tmp_path, max_entries=100)
    for i in range(60):
        h.record([1000 * i + j for j in range(25)])
        assert len(h) <= 100
    assert h.evictions > 0 and h.propose([59000, 59001, 59002, 59003], 2) == [59004, 59005]
    assert h.save() and len(disk_keys(tmp_path / "h.sqlite3")) == 100


def test_the_file_stays_within_the_cap_when_two_writers_add(tmp_path):
    a, b = history(tmp_path, max_entries=10), history(tmp_path, max_entries=10)  # both opened empty
    a.record([1, 2, 3, 4, 5, 6, 7])  # 7 entries
    assert a.save()
    b.record([11, 12, 13, 14, 15, 16, 17])  # 7 more, written after a's: 14 on disk before the trim
    assert b.save()
    keys = disk_keys(tmp_path / "h.sqlite3")
    assert len(keys) == 10 and "1,2,3" not in keys and "11,12,13" in keys  # a's oldest went


# ---------------------------------------------------------------- bad files


def test_a_corrupt_file_is_set_aside_and_the_history_starts_empty(tmp_path, capsys):
    path = tmp_path / "h.sqlite3"
    junk = os.urandom(4096)
    path.write_bytes(junk)
    h = LookupHistory(path, FP)
    assert len(h) == 0 and h.problem is not None and "corrupt" in h.problem
    (aside,) = tmp_path.glob("h.sqlite3.corrupt-*")
    assert aside.read_bytes() == junk  # renamed, not deleted
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("omnidraft: warning:") and "corrupt" in err[0]
    h.record([1, 2, 3, 4, 5])
    assert h.save()
    assert LookupHistory(path, FP).propose([1, 2, 3, 4], 1) == [5]


def test_a_file_of_another_tokenizer_is_refused(tmp_path, capsys):
    path = tmp_path / "h.sqlite3"
    theirs = LookupHistory(path, OTHER_FP)
    theirs.record([1, 2, 3, 4, 5])
    assert theirs.save()
    ours = LookupHistory(path, FP)
    assert len(ours) == 0 and ours.propose([1, 2, 3, 4], 1) == []  # never used
    assert "foreign" in ours.problem and "bbbbbbbbbbbbbbbb" in ours.problem
    (aside,) = tmp_path.glob("h.sqlite3.foreign-*")
    assert LookupHistory(aside, OTHER_FP).propose([1, 2, 3, 4], 1) == [5]  # intact where it was moved
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_an_ngram_cache_file_is_not_taken_for_a_history(tmp_path):
    path = tmp_path / "h.sqlite3"
    initialize_store(path, "p1-x")  # a pair cache: another kind of omnidraft file
    h = LookupHistory(path, FP)
    assert "foreign" in h.problem and not path.exists() and list(tmp_path.glob("h.sqlite3.foreign-*"))


def test_read_only_never_writes_nor_moves(tmp_path):
    path = tmp_path / "h.sqlite3"
    path.write_bytes(b"not a database" * 100)
    h = LookupHistory(path, FP, read_only=True)
    assert "ignoring it" in h.problem and path.read_bytes() == b"not a database" * 100
    h.record([1, 2, 3, 4, 5])
    assert len(h) == 0 and h.save() and sorted(p.name for p in tmp_path.iterdir()) == ["h.sqlite3"]


def test_a_write_failure_is_one_line_and_kept_in_memory(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    h = LookupHistory(tmp_path / "afile" / "h.sqlite3", FP)  # its folder cannot be made
    h.record([1, 2, 3, 4, 5])
    assert h.save() is False and h.save() is False
    assert h.pending > 0 and h.propose([1, 2, 3, 4], 1) == [5]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "write failed" in err[0]  # reported once


@pytest.mark.parametrize("when", ["in-transaction", 0.02, 0.25])
def test_a_writer_killed_mid_save_leaves_the_old_or_the_new_state(tmp_path, when):
    """Killed at a moment in the save loop, or (polling for sqlite's rollback journal, which exists
    only while a transaction writes) surely inside a transaction."""
    path = tmp_path / "h.sqlite3"
    old = LookupHistory(path, FP)
    old.record([1, 2, 3, 4, 5, 6])
    assert old.save()
    n, base = 3000, 1_000_000
    code = (f"h = LookupHistory(sys.argv[1], FP, max_entries=10**8)\n"
            f"r = 0\n"
            f"while True:\n"
            f"    h.record([{base} + r * {n} + i for i in range({n})])\n"
            f"    assert h.save()\n"
            f"    if r == 0:\n"
            f"        print('ready', flush=True)\n"
            f"    r += 1\n")
    proc = subprocess.Popen([sys.executable, "-c", CHILD + code, str(path)], stdout=subprocess.PIPE, text=True)
    journal = Path(f"{path}-journal")
    try:
        assert proc.stdout.readline().strip() == "ready"
        if when == "in-transaction":
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if journal.exists():  # stop the writer, then look again: a stopped writer keeps its journal
                    proc.send_signal(signal.SIGSTOP)
                    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(") ", 1)[1][0] != "T":
                        time.sleep(0.001)  # the signal is delivered when the writer next enters the kernel
                    if journal.exists():
                        break
                    proc.send_signal(signal.SIGCONT)  # the transaction committed in between: try again
        else:
            time.sleep(when)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL  # it was still saving in a loop, not finished
    if when == "in-transaction":
        assert journal.exists()  # a hot journal: the kill interrupted a write
    h = LookupHistory(path, FP)  # no exception; a leftover journal is rolled back
    assert h.problem is None and h.skipped_rows == 0
    assert h.propose([1, 2, 3, 4], 2) == [5, 6]  # what was there before survives
    rounds = Counter((int(k.split(",")[0]) - base) // n for k in disk_keys(path) if int(k.split(",")[0]) >= base)
    assert sorted(rounds) == list(range(len(rounds))) and len(rounds) >= 1  # whole saves, in order
    per_round = sum(n - order for order in ORDERS)  # one entry per n-gram of each order in a text of n ids
    assert set(rounds.values()) == {per_round}  # each save is all there or not at all
    assert len(h) == 5 + len(rounds) * per_round  # the old 5 entries and whole rounds, nothing else


# ---------------------------------------------------------------- the decoder


class ToyTarget:
    """A deterministic target: the next id is a function of the whole prefix (no model)."""

    vocab_size = 1000
    eos_ids: frozenset[int] = frozenset()
    max_context = 10_000
    tokenizer = None

    def __init__(self) -> None:
        self.forwards = 0

    @staticmethod
    def next_id(prefix: list[int]) -> int:
        return (prefix[-1] * 31 + prefix[-2] * 17 + len(prefix) * 7 + 3) % 997

    def score(self, ids, num_proposed: int) -> torch.Tensor:
        self.forwards += 1
        ids = list(ids)
        rows = torch.full((num_proposed + 1, self.vocab_size), -10.0)
        for i in range(num_proposed + 1):
            rows[i, self.next_id(ids[: len(ids) - num_proposed + i])] = 10.0
        return rows

    def reset(self) -> None:
        pass


def decode(prompt: list[int], history: LookupHistory | None, n: int = 40):
    decoder = SpeculativeDecoder(ToyTarget(), lookup=True, history=history)
    ids = [t for chunk in decoder.stream_ids(prompt, DecodeConfig(max_new_tokens=n, draft_stop="fixed")) for t in chunk]
    return ids, decoder.stats


PROMPT = [101, 202, 303, 404, 505, 606]


def test_the_decoder_drafts_from_history_and_its_output_does_not_change(tmp_path):
    plain, plain_stats = decode(PROMPT, None)
    h = history(tmp_path)
    first, first_stats = decode(PROMPT, h)
    assert first == plain and first_stats.history_steps == 0  # nothing recorded yet
    assert LookupHistory(tmp_path / "h.sqlite3", FP).propose(PROMPT, 16) == plain[:16]  # saved at the end
    second, stats = decode(PROMPT, h)
    assert second == plain
    assert stats.history_steps >= 1 and stats.lookup_accepted >= 16
    assert stats.target_forwards < plain_stats.target_forwards


def test_a_wrong_history_costs_steps_never_output(tmp_path):
    plain, _ = decode(PROMPT, None)
    h = history(tmp_path)
    h.record(PROMPT[-4:] + [(t + 1) % 997 for t in plain])  # a continuation the target never writes
    out, stats = decode(PROMPT, h)
    assert out == plain
    assert stats.history_steps >= 1 and stats.lookup_accepted < stats.lookup_proposed


def test_a_failing_save_does_not_break_decoding(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    h = LookupHistory(tmp_path / "afile" / "h.sqlite3", FP)
    plain, _ = decode(PROMPT, None)
    out, _ = decode(PROMPT, h)
    assert out == plain and h.propose(PROMPT, 3) == plain[:3]  # learned in memory all the same
    assert "write failed" in capsys.readouterr().err


# ---------------------------------------------------------------- omnidraft cache


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_cache_stats_lists_histories_and_writes_nothing(tmp_path, capsys, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("OMNIDRAFT_HOME", str(home))
    ours = LookupHistory(history_path(FP, home), FP)
    ours.record([1, 2, 3, 4, 5, 6])
    assert ours.save()
    store = home / "cache_store"
    (store / "lookup-cafecafecafecafe.sqlite3").write_bytes(b"junk" * 300)
    before = snapshot(home)
    assert main(["cache", "stats", "--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    (listed,) = doc["lookup_histories"]
    assert listed["entries"] == 5 and listed["target"] == FP and listed["bytes_on_disk"] > 0
    assert [p["path"] for p in doc["problems"]] == [str(store / "lookup-cafecafecafecafe.sqlite3")]
    assert len(out.err.strip().splitlines()) == 1
    assert snapshot(home) == before  # read only: nothing created, changed or moved
    assert main(["cache", "stats"]) == 0
    assert "lookup history of target tokenizer aaaaaaaaaaaaaaaa" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("OMNIDRAFT_HOME", str(empty))
    assert main(["cache", "stats"]) == 0
    assert list(empty.iterdir()) == []


def test_cache_clear_removes_only_verified_histories(tmp_path, capsys, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("OMNIDRAFT_HOME", str(home))
    ours = LookupHistory(history_path(FP, home), FP)
    ours.record([1, 2, 3, 4, 5, 6])
    assert ours.save()
    store = home / "cache_store"
    user_db = store / "lookup-0123456789abcdef.sqlite3"  # someone's own database under our naming
    con = sqlite3.connect(str(user_db))
    con.execute("CREATE TABLE notes (body TEXT)")
    con.execute("INSERT INTO notes VALUES ('precious')")
    con.commit()
    con.close()
    junk = store / "lookup-cafecafecafecafe.sqlite3"
    junk.write_bytes(b"junk" * 300)
    kept = {p: p.read_bytes() for p in (user_db, junk)}
    assert main(["cache", "clear", "--yes"]) == 0
    out = capsys.readouterr()
    assert "removed lookup history lookup-aaaaaaaaaaaaaaaa.sqlite3 (5 entries)" in out.out
    assert out.err.count("not removing") == 2
    assert not history_path(FP, home).exists()
    assert {p: p.read_bytes() for p in kept} == kept  # untouched
    assert sorted(p.name for p in store.iterdir()) == sorted(p.name for p in kept)
