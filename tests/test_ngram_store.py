"""The persistent n-gram store: persistence, eviction, pair isolation, crash safety, concurrency, CLI.

Every test uses real sqlite files under tmp_path; the crash and concurrency tests use real
processes (``sys.executable``) killed with SIGKILL or racing on one file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnidraft.cli import cache as cache_cli
from omnidraft.errors import OmnidraftError
from omnidraft.ngram.files import (
    FORMAT_VERSION,
    NGRAM_TABLE,
    decode_key,
    decode_value,
    default_store_path,
    encode_key,
    initialize_store,
    list_store_paths,
)
from omnidraft.ngram.store import PersistentNgramCache
from omnidraft.ngram.trie import NgramTrie
from omnidraft.identity import pair_id

PAIR = "aaaa1111-bbbb2222"
REPO = Path(__file__).resolve().parents[1]


def open_cache(path: Path, **kwargs) -> PersistentNgramCache:
    return PersistentNgramCache(path, PAIR, **kwargs)


def disk_rows(path: Path) -> dict[tuple[int, ...], list[int]]:
    """Every stored row, decoded strictly (a malformed row fails the test)."""
    con = sqlite3.connect(str(path))
    try:
        rows = con.execute(f'SELECT key, value FROM "{NGRAM_TABLE}"').fetchall()
    finally:
        con.close()
    out = {}
    for raw_key, raw_value in rows:
        meta = decode_value(raw_value)
        out[decode_key(raw_key)] = [meta.target, meta.proposed, meta.accepted, meta.last_used]
    return out


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_py(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=child_env(), cwd=str(REPO))


# ---------------------------------------------------------------- persistence


def test_is_an_ngram_trie_and_round_trips_in_process(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    with open_cache(path) as cache:
        assert isinstance(cache, NgramTrie)
        assert cache.add([1, 2], 12) is True
        assert cache.add([1, 2, 3], 123) is True
        assert cache.add([1, 2], 13) is False  # update, not new
        cache.note_proposed([1, 2, 3])
        cache.note_proposed([1, 2, 3])
        cache.note_accepted([1, 2, 3])
        assert cache.longest_match([1, 2, 3, 4]) == (3, 123)
    with open_cache(path) as again:
        assert dict(again.items()) == {(1, 2): 13, (1, 2, 3): 123}
        meta = again.entry([1, 2, 3])
        assert (meta.target, meta.proposed, meta.accepted) == (123, 2, 1)
        assert again.longest_match([0, 1, 2], start=1) == (2, 13)


def test_round_trip_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    with open_cache(path) as cache:
        for i in range(20):
            cache.add([i, i + 1], 1000 + i)
        cache.note_accepted([3, 4])
    child = """
import json, sys
from omnidraft.ngram.store import PersistentNgramCache
with PersistentNgramCache(sys.argv[1], sys.argv[2]) as c:
    seen = {",".join(map(str, k)): t for k, t in c.items()}
    acc = c.entry([3, 4]).accepted
    c.add([7, 7, 7], 777)
    c.note_proposed([7, 7, 7])
print(json.dumps({"seen": seen, "accepted": acc}))
"""
    result = run_py(child, path, PAIR)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["seen"] == {f"{i},{i + 1}": 1000 + i for i in range(20)}
    assert report["accepted"] == 1
    with open_cache(path) as cache:
        assert cache.get([7, 7, 7]) == 777
        assert cache.entry([7, 7, 7]).proposed == 1
        assert len(cache) == 21


def test_pending_changes_are_written_at_interpreter_exit(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    child = """
import sys
from omnidraft.ngram.store import PersistentNgramCache
cache = PersistentNgramCache(sys.argv[1], sys.argv[2], flush_every=1000)
cache.add([4, 5, 6], 456)  # never flushed or closed explicitly
"""
    result = run_py(child, path, PAIR)
    assert result.returncode == 0, result.stderr
    assert disk_rows(path)[(4, 5, 6)][0] == 456


def test_writes_are_batched(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    cache = open_cache(path, flush_every=5)
    for i in range(4):
        cache.add([i, 0], i)
    assert disk_rows(path) == {}  # nothing written per token
    assert cache.pending == 4
    cache.add([4, 0], 4)  # the 5th change writes the batch
    assert set(disk_rows(path)) == {(i, 0) for i in range(5)}
    assert cache.pending == 0
    cache.add([5, 0], 5)
    cache.close()
    assert (5, 0) in disk_rows(path)


def test_malformed_rows_are_skipped_and_removed(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    with open_cache(path) as cache:
        cache.add([1, 2], 3)
    con = sqlite3.connect(str(path))
    with con:
        con.executemany(f'INSERT INTO "{NGRAM_TABLE}" (key, value) VALUES (?, ?)',
                        [("5", "[1,0,0,0]"), ("x,y", "[1,0,0,0]"), ("6,7", "not json"), ("8,9", "[1,-1,0,0]"),
                         (b"1,3", "[1,0,0,0]"), (7, "[1,0,0,0]")])
    con.close()
    with open_cache(path) as cache:
        assert cache.skipped_rows == 6
        assert dict(cache.items()) == {(1, 2): 3}
        cache.add([3, 4], 5)  # any write batch also deletes the bad rows
    assert set(disk_rows(path)) == {(1, 2), (3, 4)}


# ---------------------------------------------------------------- eviction


def test_lru_evicts_least_recently_used(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    with open_cache(path, max_entries=3, policy="lru") as cache:
        for key in ([1, 1], [2, 2], [3, 3]):
            cache.add(key, key[0])
        cache.note_proposed([1, 1])  # a hit makes (1,1) the most recent
        cache.add([4, 4], 4)
        assert cache.get([2, 2]) is None and len(cache) == 3
        cache.add([1, 1], 1)  # re-adding is a use too
        cache.add([5, 5], 5)
        assert dict(cache.items()) == {(1, 1): 1, (4, 4): 4, (5, 5): 5}
        assert cache.evictions == 2
        before = cache.version
        cache.add([6, 6], 6)  # same len() after the eviction, but the key set changed
        assert len(cache) == 3 and cache.version > before
        before = cache.version
        cache.note_proposed([6, 6])
        assert cache.version == before  # a hit changes no key
        cache.remove([6, 6])
        cache.add([5, 5], 5)  # re-adding an existing entry unchanged
        assert cache.version == before + 1
        assert set(k for k, _ in cache.items()) == {(1, 1), (5, 5)}  # (4,4) made room for (6,6)
    assert set(disk_rows(path)) == {(1, 1), (5, 5)}


def test_lfu_evicts_least_used_with_lru_tiebreak(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    with open_cache(path, max_entries=3, policy="lfu") as cache:
        for key in ([1, 1], [2, 2], [3, 3]):
            cache.add(key, key[0])
        for _ in range(3):
            cache.note_accepted([1, 1])
        cache.note_proposed([2, 2])
        cache.note_proposed([3, 3])  # (2,2) and (3,3) tie at 1 hit; (2,2) was used longer ago
        cache.add([4, 4], 4)
        assert set(k for k, _ in cache.items()) == {(1, 1), (3, 3), (4, 4)}
        # the new entry was not evicted on arrival, but with 0 hits it is the next to go
        cache.add([5, 5], 5)
        assert set(k for k, _ in cache.items()) == {(1, 1), (3, 3), (5, 5)}
    assert set(disk_rows(path)) == {(1, 1), (3, 3), (5, 5)}


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cap_is_respected_in_memory_and_on_disk(tmp_path: Path, policy: str) -> None:
    path = tmp_path / "c.sqlite"
    rng = random.Random(7)
    with open_cache(path, max_entries=40, policy=policy, flush_every=16) as cache:
        for _ in range(600):
            key = [rng.randrange(30), rng.randrange(30)]
            if rng.random() < 0.5:
                cache.add(key, rng.randrange(100))
            else:
                cache.note_proposed(key)
            assert len(cache) <= 40
        in_memory = dict(cache.items())
    assert len(in_memory) == 40
    assert {k: v[0] for k, v in disk_rows(path).items()} == in_memory


def test_no_cap_keeps_everything(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    with open_cache(path, max_entries=None) as cache:
        for i in range(500):
            cache.add([i, i], i)
        assert cache.evictions == 0
    assert len(disk_rows(path)) == 500


def test_reopening_with_a_smaller_cap_trims_the_store(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    with open_cache(path) as cache:
        for i in range(20):
            cache.add([i, 0], i)
    with open_cache(path, max_entries=5, policy="lru") as cache:
        assert set(k for k, _ in cache.items()) == {(i, 0) for i in range(15, 20)}
    assert set(disk_rows(path)) == {(i, 0) for i in range(15, 20)}


def test_invalid_options_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        open_cache(tmp_path / "a.sqlite", max_entries=0)
    with pytest.raises(ValueError):
        open_cache(tmp_path / "b.sqlite", policy="fifo")
    with pytest.raises(ValueError):
        PersistentNgramCache(tmp_path / "c.sqlite", "../escape")


# ---------------------------------------------------------------- frozen


def test_frozen_reads_but_never_writes(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    with open_cache(path) as cache:
        cache.add([1, 2], 3)
        cache.note_proposed([1, 2])
    before = disk_rows(path)
    mtime = path.stat().st_mtime_ns
    frozen = open_cache(path, frozen=True, flush_every=1)
    assert frozen.longest_match([1, 2, 9]) == (2, 3)
    assert frozen.add([5, 6], 7) is False
    assert frozen.get([5, 6]) is None
    frozen.note_proposed([1, 2])
    frozen.note_accepted([1, 2])
    assert frozen.hits_proposed == 1  # session counters still count
    assert frozen.flush() is True
    frozen.close()
    assert disk_rows(path) == before
    assert path.stat().st_mtime_ns == mtime


def test_frozen_on_a_missing_file_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "none.sqlite"
    cache = open_cache(path, frozen=True)
    assert len(cache) == 0
    cache.close()
    assert not path.exists()


# ---------------------------------------------------------------- pairs


class FakeTokenizer:
    """Just what pair_id reads from a Hugging Face tokenizer."""

    def __init__(self, vocab: dict[str, int], specials: tuple[str, ...] = ()) -> None:
        self._vocab = vocab
        self.all_special_tokens = list(specials)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


def test_pair_id_is_stable_and_sensitive() -> None:
    drafter = FakeTokenizer({"a": 0, "b": 1, "ab": 2}, ("<s>",))
    target = FakeTokenizer({"ab": 0, "a": 1, "b": 2})
    same_drafter_other_order = FakeTokenizer({"ab": 2, "b": 1, "a": 0}, ("<s>",))
    pid = pair_id(drafter, target)
    assert pid == pair_id(same_drafter_other_order, target)
    assert pid != pair_id(target, drafter)  # direction matters
    assert pid != pair_id(FakeTokenizer({"a": 0, "b": 1, "ab": 3}, ("<s>",)), target)  # one id moved
    assert pid != pair_id(FakeTokenizer({"a": 0, "b": 1, "ab": 2}, ("</s>",)), target)  # special token
    assert pid != pair_id(drafter, FakeTokenizer({"ab": 0, "a": 1, "c": 2}))
    assert default_store_path(pid, home=Path("/tmp/h")).name == f"{pid}.sqlite"


def test_pairs_are_isolated(tmp_path: Path) -> None:
    home = tmp_path / "home"
    pa, pb = "pair-a", "pair-b"
    with PersistentNgramCache(default_store_path(pa, home), pa) as a:
        a.add([1, 2], 100)
    with PersistentNgramCache(default_store_path(pb, home), pb) as b:
        assert len(b) == 0
        b.add([1, 2], 200)
    assert [p.name for p in list_store_paths(home)] == ["pair-a.sqlite", "pair-b.sqlite"]
    with PersistentNgramCache(default_store_path(pa, home), pa) as a:
        assert a.get([1, 2]) == 100


def test_a_store_opened_for_another_pair_is_set_aside(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "shared.sqlite"
    with PersistentNgramCache(path, "pair-a") as a:
        a.add([1, 2], 100)
    capsys.readouterr()
    with PersistentNgramCache(path, "pair-b") as b:
        assert len(b) == 0
        assert b.problem and "foreign" in b.problem
        b.add([3, 4], 5)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "foreign" in err and "pair-a" in err
    aside = list(tmp_path.glob("shared.sqlite.foreign-*"))
    assert len([p for p in aside if not p.name.endswith(("-wal", "-shm"))]) == 1
    assert disk_rows(next(p for p in aside if not p.name.endswith(("-wal", "-shm")))) != {}  # kept, not deleted


# ---------------------------------------------------------------- bad files


def test_corrupt_file_gives_one_line_and_is_set_aside(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / f"{PAIR}.sqlite"
    garbage = random.Random(3).randbytes(8192)
    path.write_bytes(garbage)
    cache = open_cache(path)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "corrupt" in lines[0] and str(path) in lines[0] and "moved it aside" in lines[0]
    aside = list(tmp_path.glob(f"{path.name}.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == garbage
    assert len(cache) == 0
    cache.add([1, 2], 3)
    cache.close()
    assert disk_rows(path) and open_cache(path).get([1, 2]) == 3


def test_truncated_store_is_corrupt(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "c.sqlite"
    with open_cache(path) as cache:
        for i in range(3000):
            cache.add([i, 1, 2, 3], i)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    cache = open_cache(path)
    assert len(cache) == 0 and cache.problem and "corrupt" in cache.problem
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    cache.close()


def test_other_sqlite_databases_and_newer_formats_are_foreign(tmp_path: Path) -> None:
    other = tmp_path / "other.sqlite"
    con = sqlite3.connect(str(other))
    with con:
        con.execute("CREATE TABLE users (name TEXT)")
        con.execute("INSERT INTO users VALUES ('x')")
    con.close()
    cache = open_cache(other)
    assert cache.problem and "foreign" in cache.problem
    cache.close()
    assert list(tmp_path.glob("other.sqlite.foreign-*"))

    newer = tmp_path / "newer.sqlite"
    initialize_store(newer, PAIR)
    con = sqlite3.connect(str(newer))
    with con:
        record = {"kind": "omnidraft-ngram-cache", "format": FORMAT_VERSION + 1, "pair_id": PAIR}
        con.execute("UPDATE meta SET value = ? WHERE key = 'meta'", (json.dumps(record),))
    con.close()
    cache = open_cache(newer)
    assert cache.problem and "format" in cache.problem
    cache.close()


def test_frozen_reports_a_corrupt_file_but_leaves_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "c.sqlite"
    path.write_bytes(b"\x00not sqlite" * 100)
    cache = open_cache(path, frozen=True)
    assert len(cache) == 0 and "corrupt" in cache.problem
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert path.exists() and not list(tmp_path.glob("c.sqlite.corrupt-*"))


# ---------------------------------------------------------------- concurrency


def test_a_busy_store_defers_the_batch_instead_of_failing(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    cache = open_cache(path, busy_timeout=0.05)
    blocker = sqlite3.connect(str(path), isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
    cache.add([1, 2], 3)
    assert cache.flush() is False
    assert cache.pending == 1 and cache.get([1, 2]) == 3
    blocker.execute("ROLLBACK")
    blocker.close()
    assert cache.flush() is True
    assert set(disk_rows(path)) == {(1, 2)}
    cache.close()


def test_two_handles_merge_counts_instead_of_clobbering(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    with open_cache(path) as cache:
        cache.add([9, 9], 99)
    a, b = open_cache(path), open_cache(path)
    a.add([1, 1], 1)
    b.add([2, 2], 2)
    for _ in range(3):
        a.note_proposed([9, 9])
    for _ in range(5):
        b.note_proposed([9, 9])
    b.note_accepted([9, 9])
    a.close()
    b.close()
    rows = disk_rows(path)
    assert set(rows) == {(1, 1), (2, 2), (9, 9)}
    assert rows[(9, 9)][1:3] == [8, 1]


CONCURRENT_WRITER = """
import json, sys
from omnidraft.ngram.store import PersistentNgramCache
path, pair, who, n, cap = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
cache = PersistentNgramCache(path, pair, flush_every=8, max_entries=None if cap == "none" else int(cap))
for i in range(n):
    cache.add((who, i, 9), who * 10000 + i)
    cache.note_proposed((1000, 1000))
    if i % 2 == 0:
        cache.note_accepted((1000, 1000))
cache.close()
print(json.dumps({"pending": cache.pending}))
"""


@pytest.mark.parametrize("cap", [None, 100])
def test_two_writer_processes(tmp_path: Path, cap: int | None) -> None:
    path = tmp_path / "c.sqlite"
    n = 300
    with open_cache(path) as cache:
        cache.add([1000, 1000], 1)
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_WRITER, str(path), PAIR, str(who), str(n),
                               "none" if cap is None else str(cap)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
             for who in (1, 2)]
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert err == ""  # no warnings, no tracebacks
        assert json.loads(out)["pending"] == 0
    rows = disk_rows(path)  # decodes every row strictly
    with open_cache(path, max_entries=cap) as cache:
        assert cache.problem is None
    if cap is None:
        assert set(rows) == {(1000, 1000)} | {(who, i, 9) for who in (1, 2) for i in range(n)}
        assert rows[(1000, 1000)][1:3] == [2 * n, 2 * ((n + 1) // 2)]  # both writers' hits, merged
    else:
        assert len(rows) <= cap
        assert (1000, 1000) in rows  # the hottest key survives LRU


# ---------------------------------------------------------------- crash safety

KILLED_WRITER = """
import sys
from omnidraft.ngram.store import PersistentNgramCache
path, pair, batch, size, cap = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
cache = PersistentNgramCache(path, pair, flush_every=10**9, max_entries=None if cap == "none" else int(cap))
print("ready", flush=True)
while True:
    for j in range(size):
        cache.add((batch, j, 1), batch * 1000 + j)
        if j % 7 == 0:
            cache.note_proposed((batch - 1, j, 1))  # updates rows of the previous batch
    assert cache.flush()
    print(batch, flush=True)
    batch += 1
"""


@pytest.mark.parametrize("kills, cap", [(24, None), (6, 150)])
def test_sigkill_mid_write_leaves_old_or_new_state(tmp_path: Path, kills: int, cap: int | None) -> None:
    path = tmp_path / "c.sqlite"
    size = 40
    rng = random.Random(11 + kills)
    reported: set[int] = set()
    next_batch = 1
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path), PAIR, str(next_batch), str(size),
                                 "none" if cap is None else str(cap)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        reported |= {int(line) for line in out.split()}

        cache = open_cache(path, max_entries=cap)  # opens cleanly: nothing set aside, nothing skipped
        assert cache.problem is None and cache.skipped_rows == 0
        cache.close()
        rows = disk_rows(path)  # every persisted entry is well-formed
        batches: dict[int, set[int]] = {}
        for (batch, j, one), (target, proposed, _acc, _lu) in rows.items():
            assert one == 1 and target == batch * 1000 + j
            batches.setdefault(batch, set()).add(j)
        if cap is None:
            assert set(batches) >= reported  # every reported commit survived the kill
            for batch, js in batches.items():  # no batch is half-written
                assert js == set(range(size)), f"batch {batch} partially written"
                for j in range(0, size, 7):  # updates of the same transaction landed together
                    assert rows[(batch, j, 1)][1] == (1 if batch + 1 in batches else 0)
        else:
            assert len(rows) <= cap
        next_batch = max([next_batch - 1, *batches, *reported]) + 1
    assert reported, "the writer never got to commit: kills came too early to test anything"
    assert not list(tmp_path.glob("*.corrupt-*")) and not list(tmp_path.glob("*.foreign-*"))


# ---------------------------------------------------------------- clear and CLI


def test_clear_empties_memory_and_disk(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    with open_cache(path) as cache:
        for i in range(50):
            cache.add([i, 1], i)
        assert cache.clear() == 50
        assert len(cache) == 0 and cache.longest_match([3, 1]) is None
        cache.add([7, 8], 9)
    assert set(disk_rows(path)) == {(7, 8)}
    with pytest.raises(OmnidraftError):
        open_cache(path, frozen=True).clear()


def cli(argv: list[str], home: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Run ``omnidraft cache ...`` in-process the way omnidraft.cli.main does (errors -> 2)."""
    parser = argparse.ArgumentParser(prog="omnidraft")
    cache_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cache", *argv])
    monkeypatch.setenv("OMNIDRAFT_HOME", str(home))
    try:
        return int(args.func(args) or 0)
    except OmnidraftError as exc:
        print(f"omnidraft: error: {exc}", file=sys.stderr)
        return 2


def make_store(home: Path, pair: str, entries: dict[tuple[int, ...], int], accepted: tuple[int, ...] | None = None) -> Path:
    path = default_store_path(pair, home)
    with PersistentNgramCache(path, pair) as cache:
        for key, target in entries.items():
            cache.add(key, target)
        if accepted:
            for _ in range(3):
                cache.note_proposed(accepted)
            cache.note_accepted(accepted)
            cache.note_accepted(accepted)
    return path


def test_cli_stats_json_in_a_subprocess(tmp_path: Path) -> None:
    home = tmp_path / "home"
    make_store(home, "p1-x", {(1, 2): 12, (3, 4, 5): 345}, accepted=(3, 4, 5))
    make_store(home, "p2-y", {(6, 7): 67})
    result = subprocess.run([sys.executable, "-m", "omnidraft", "--home", str(home), "cache", "stats", "--json"],
                            capture_output=True, text=True, timeout=120, env=child_env(), cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    by_pair = {c["pair_id"]: c for c in doc["caches"]}
    assert set(by_pair) == {"p1-x", "p2-y"} and doc["problems"] == []
    p1 = by_pair["p1-x"]
    assert p1["entries"] == 2
    assert p1["bytes_on_disk"] >= default_store_path("p1-x", home).stat().st_size > 0
    assert p1["bytes_in_memory"] > 0
    assert (p1["hits_proposed"], p1["hits_accepted"]) == (3, 2)
    assert p1["accept_rate"] == pytest.approx(2 / 3)
    assert p1["top"][0] == {"drafter_ids": [3, 4, 5], "target_id": 345, "proposed": 3, "accepted": 2}
    assert by_pair["p2-y"]["accept_rate"] is None


def test_cli_stats_reports_a_corrupt_store_in_one_line_and_goes_on(tmp_path: Path) -> None:
    home = tmp_path / "home"
    make_store(home, "good", {(1, 2): 3})
    bad = default_store_path("bad", home)
    bad.write_bytes(b"this is not a database" * 50)
    result = subprocess.run([sys.executable, "-m", "omnidraft", "--home", str(home), "cache", "stats", "--json"],
                            capture_output=True, text=True, timeout=120, env=child_env(), cwd=str(tmp_path))
    assert result.returncode == 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "corrupt" in lines[0] and "bad.sqlite" in lines[0]
    doc = json.loads(result.stdout)
    assert [c["pair_id"] for c in doc["caches"]] == ["good"]
    assert len(doc["problems"]) == 1 and doc["problems"][0]["path"] == str(bad)
    assert bad.exists()  # stats is read-only: the next writer moves it aside


def test_cli_stats_text_and_pair_filter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture) -> None:
    home = tmp_path / "home"
    make_store(home, "p1", {(1, 2): 12}, accepted=(1, 2))
    make_store(home, "p2", {(6, 7): 67})
    assert cli(["stats", "--pair", "p1"], home, monkeypatch) == 0
    out = capsys.readouterr().out
    assert "pair p1" in out and "pair p2" not in out and "[1, 2] -> 12" in out and "66.7%" in out
    assert cli(["stats", "--pair", "nope"], home, monkeypatch) == 2
    assert "no n-gram cache for pair 'nope'" in capsys.readouterr().err


def test_cli_export_writes_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    make_store(home, "p1", {(1, 2): 12, (3, 4, 5): 345}, accepted=(1, 2))
    make_store(home, "p2", {(6, 7): 67})
    out = tmp_path / "dump.jsonl"
    assert cli(["export", str(out)], home, monkeypatch) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["pair_id"], tuple(r["drafter_ids"]), r["target_id"]) for r in records} == {
        ("p1", (1, 2), 12), ("p1", (3, 4, 5), 345), ("p2", (6, 7), 67)}
    assert next(r for r in records if r["drafter_ids"] == [1, 2])["accepted"] == 2
    assert cli(["export", str(tmp_path / "p2.jsonl"), "--pair", "p2"], home, monkeypatch) == 0
    assert len((tmp_path / "p2.jsonl").read_text().splitlines()) == 1
    assert cli(["export", str(tmp_path / "missing-dir" / "x.jsonl")], home, monkeypatch) == 2


def test_cli_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    home = tmp_path / "home"
    p1 = make_store(home, "p1", {(1, 2): 12, (3, 4): 34})
    p2 = make_store(home, "p2", {(6, 7): 67})
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # not a terminal: no prompt
    assert cli(["clear"], home, monkeypatch) == 2
    assert "without --yes" in capsys.readouterr().err
    assert len(disk_rows(p1)) == 2
    assert cli(["clear", "--pair", "p1", "--yes"], home, monkeypatch) == 0
    assert "cleared 2 entries" in capsys.readouterr().out
    assert disk_rows(p1) == {} and len(disk_rows(p2)) == 1
    assert cli(["clear", "--yes"], home, monkeypatch) == 0
    assert disk_rows(p2) == {}


def test_key_encoding_round_trips() -> None:
    assert encode_key((12, 345, 6)) == "12,345,6"
    assert decode_key("12,345,6") == (12, 345, 6)
    for bad in ("", "1", "1,", "a,b", "-1,2", "1;2"):
        with pytest.raises(ValueError):
            decode_key(bad)
