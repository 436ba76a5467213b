"""Persistent n-gram cache: the in-memory trie, loaded from and written back to one sqlite file.

The cache is what lets a drafter's sub-tokens ('f', 'la', 'ke') be proposed as the target's one
token ('flake'). It learns online, so it has to survive restarts, stay small on a phone and never
corrupt. The file layout and its checks are in ``files.py``, eviction in ``eviction.py``; this
module is the mapping itself:

- The decode loop talks to :class:`PersistentNgramCache`, an :class:`NgramTrie`, so lookups stay
  in memory; changes are written back in batches (every ``flush_every`` changes, and on close),
  each batch one sqlite transaction in WAL mode: a process killed at any moment leaves the old or
  the new state.
- A writer writes only the keys it changed, adding its *count deltas* to what is on disk, so two
  processes sharing one store merge instead of clobbering each other.
- Bounded size with LRU or LFU eviction, applied in memory and on disk in the same flush; or no
  cap; or ``frozen`` (read-only) for evaluation.

sqlitedict runs its connection on a worker thread and re-raises worker errors on the next call;
it cannot report a failed ``COMMIT`` issued through its own ``commit()`` (the worker dies and the
caller hangs), so batches are issued as plain ``BEGIN IMMEDIATE`` / ``COMMIT`` statements through
its connection, where errors come back to us. Its ``timeout`` argument is only the worker's
start-up wait; sqlite's lock wait is set with ``PRAGMA busy_timeout``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sqlite3
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from sqlitedict import SqliteDict

from omnidraft.console import warn
from omnidraft.errors import OmnidraftError
from omnidraft.ngram.eviction import POLICIES, EvictionQueue, Policy, priority
from omnidraft.ngram.files import (
    DEFAULT_BUSY_TIMEOUT_S,
    NGRAM_TABLE,
    STORE_SUFFIX,
    EntryMeta,
    Key,
    StoreProblem,
    bytes_on_disk,
    decode_key,
    decode_value,
    default_store_path,
    encode_key,
    encode_value,
    immediate_transaction,
    initialize_store,
    inspect_store,
    is_busy,
    is_omnidraft_store,
    report_problem,
    store_files,
)
from omnidraft.ngram.trie import NgramTrie, TrieNode
from omnidraft.identity import check_pair_id, pair_id

_FLUSH_ATTEMPTS = 2  # automatic flushes: a busy store is retried at the next batch anyway
_CLOSE_ATTEMPTS = 8  # the last flush has no next batch; opening has no fallback either
_IN_CHUNK = 500  # bound parameters per SELECT ... IN (...), below sqlite's oldest limit (999)

# Every sqlitedict error is re-raised to this module and handled here; its own multi-line ERROR
# logs would only duplicate them on stderr (and break the one-line rule for a bad cache file).
_sqlitedict_log = logging.getLogger("sqlitedict")
_sqlitedict_log.addHandler(logging.NullHandler())
_sqlitedict_log.propagate = False


# ---------------------------------------------------------------- the store


class PersistentNgramCache(NgramTrie):
    """An :class:`NgramTrie` that persists to one sqlite file and bounds its size.

    Single-threaded like the trie: the decode loop owns it. Several processes may share a file.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        pair_id: str,
        *,
        max_entries: int | None = None,
        policy: Policy = "lru",
        frozen: bool = False,
        flush_every: int = 64,
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT_S,
    ) -> None:
        super().__init__()
        if max_entries is not None and max_entries < 1:
            raise ValueError("max_entries must be >= 1, or None for no cap")
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; expected one of {', '.join(POLICIES)}")
        if flush_every < 1:
            raise ValueError("flush_every must be >= 1")
        self.path = Path(path)
        self.pair_id = check_pair_id(pair_id)
        self.max_entries = max_entries
        self.policy: Policy = policy
        self.frozen = frozen
        self.flush_every = flush_every
        self.busy_timeout = busy_timeout
        self.problem: str | None = None  # set when the file was corrupt/foreign and not used
        self.skipped_rows = 0  # malformed rows seen at load (not loaded; deleted by the next flush)
        self.evictions = 0
        self._meta: dict[Key, EntryMeta] = {}
        self._deltas: dict[Key, list[int]] = {}  # key -> [proposed, accepted] since the last flush
        self._deleted: set[str] = set()  # encoded keys to delete at the next flush
        self._queue = EvictionQueue(self._meta, policy)  # used only when bounded
        self._clock = 0
        self._ops = 0
        self._warned_write = False
        self._db: SqliteDict | None = None
        self._open()
        if self._db is not None:
            atexit.register(_close_at_exit, weakref.ref(self))

    # ---- opening and loading

    def _open(self) -> None:
        """Check the file, set it aside if bad, then load it (and keep it open unless frozen)."""
        for attempt in range(_CLOSE_ATTEMPTS):
            try:
                has_data = inspect_store(self.path, self.pair_id, self.busy_timeout)
                break
            except StoreProblem as problem:
                self._report(problem)
                has_data = False
                break
            except sqlite3.OperationalError as exc:
                if not is_busy(exc) or attempt == _CLOSE_ATTEMPTS - 1:
                    raise OmnidraftError(f"cannot open n-gram cache {self.path}: {exc}") from exc
        if self.frozen:
            if has_data:
                # flag "c" only runs CREATE TABLE IF NOT EXISTS on a table inspect_store saw, so it
                # writes nothing; flag "r" would leak a connection (sqlitedict's get_tablenames).
                db = self._sqlitedict(flag="c")
                try:
                    self._load(db)
                finally:
                    db.close()
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OmnidraftError(f"cannot create {self.path.parent}: {exc.strerror or exc}") from None
        for attempt in range(_CLOSE_ATTEMPTS):
            try:
                initialize_store(self.path, self.pair_id, self.busy_timeout)
                break
            except StoreProblem as problem:  # another process created it for another pair meanwhile
                raise OmnidraftError(f"n-gram cache {self.path} is {problem.kind}: {problem.detail}") from problem
            except sqlite3.Error as exc:
                if not is_busy(exc) or attempt == _CLOSE_ATTEMPTS - 1:
                    raise OmnidraftError(f"cannot create n-gram cache {self.path}: {exc}") from exc
        self._db = self._sqlitedict(flag="c")
        self._db.conn.select_one(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
        # WAL + NORMAL: a killed process loses nothing committed; power loss may lose the last
        # batches but never corrupts (sqlitedict's default is synchronous=OFF).
        self._db.conn.select_one("PRAGMA synchronous = NORMAL")
        # Keep the WAL small on a phone: checkpoint every ~1 MiB and truncate it back to that size.
        self._db.conn.select_one("PRAGMA wal_autocheckpoint = 256")
        self._db.conn.select_one("PRAGMA journal_size_limit = 1048576")
        self._load(self._db)

    def _sqlitedict(self, flag: str) -> SqliteDict:
        # journal_mode must be given: sqlitedict would otherwise switch the file back to DELETE.
        return SqliteDict(
            str(self.path), tablename=NGRAM_TABLE, flag=flag, autocommit=False, journal_mode="WAL",
            encode=encode_value, decode=decode_value, outer_stack=False,
        )

    def _report(self, problem: StoreProblem) -> None:
        """One line on stderr; the file is moved aside (writable) or ignored (frozen)."""
        self.problem = report_problem("n-gram cache", self.path, problem, self.frozen)

    def _load(self, db: SqliteDict) -> None:
        """Fill the trie from the store, oldest first; skip malformed rows; apply the cap."""
        loaded: list[tuple[Key, EntryMeta]] = []
        for raw_key, raw_value in db.conn.select(f'SELECT key, value FROM "{NGRAM_TABLE}"'):
            try:
                loaded.append((decode_key(raw_key), decode_value(raw_value)))
            except (ValueError, TypeError, AttributeError):  # e.g. a BLOB or integer key
                self.skipped_rows += 1
                self._deleted.add(raw_key)
        loaded.sort(key=lambda kv: kv[1].last_used)
        for key, meta in loaded:
            NgramTrie.add(self, key, meta.target)
            self._meta[key] = meta
            self._clock = max(self._clock, meta.last_used)
        if self.max_entries is not None:
            self._queue.rebuild()
            while len(self._meta) > self.max_entries:
                self._evict_one(exclude=None)

    # ---- eviction bookkeeping

    def _touch(self, key: Key, meta: EntryMeta) -> None:
        if self.max_entries is not None:
            self._queue.touch(key, meta)

    def _evict_one(self, exclude: Key | None) -> None:
        key = self._queue.victim(exclude)
        if key is None:
            return
        self._forget(key)
        self._deleted.add(encode_key(key))
        self.evictions += 1

    def _forget(self, key: Key) -> None:
        """Drop a key from memory only."""
        NgramTrie.remove(self, key)
        self._meta.pop(key, None)
        self._deltas.pop(key, None)

    def _tick(self) -> int:
        """Last-use stamp: wall-clock microseconds, strictly increasing within this process, so
        LRU order is exact here and roughly comparable with other processes' stamps."""
        self._clock = max(self._clock + 1, time.time_ns() // 1000)
        return self._clock

    def _changed(self) -> None:
        self._ops += 1
        if self._ops >= self.flush_every:
            self.flush()

    # ---- the NgramTrie interface

    def add(self, drafter_ids: Sequence[int], target_id: int) -> bool:
        """Insert or update an n-gram; evicts one entry when over the cap. Frozen: no-op, False."""
        if len(drafter_ids) < 2:
            raise ValueError("an n-gram maps at least 2 drafter tokens to one target token")
        if self.frozen:
            return False
        key = tuple(int(t) for t in drafter_ids)
        is_new = super().add(key, target_id)
        meta = self._meta.get(key)
        if meta is None:
            meta = self._meta[key] = EntryMeta(int(target_id), 0, 0, self._tick())
        else:
            meta.target, meta.last_used = int(target_id), self._tick()
        self._deltas.setdefault(key, [0, 0])
        self._deleted.discard(encode_key(key))
        self._touch(key, meta)
        if is_new and self.max_entries is not None and len(self._meta) > self.max_entries:
            self._evict_one(exclude=key)
        self._changed()
        return is_new

    def remove(self, drafter_ids: Sequence[int]) -> bool:
        """Delete a key here and (at the next flush) in the store."""
        key = tuple(int(t) for t in drafter_ids)
        existed = key in self._meta
        if existed and not self.frozen:
            self._forget(key)
            self._deleted.add(encode_key(key))
            self._changed()
        return existed and not self.frozen

    def note_proposed(self, drafter_ids: Sequence[int]) -> None:
        """Forward translation used this key: count the hit and refresh its recency."""
        super().note_proposed(drafter_ids)
        self._hit(drafter_ids, 0)

    def note_accepted(self, drafter_ids: Sequence[int]) -> None:
        """The target accepted a proposal from this key: count it and refresh its recency."""
        super().note_accepted(drafter_ids)
        self._hit(drafter_ids, 1)

    def _hit(self, drafter_ids: Sequence[int], which: int) -> None:
        if self.frozen:
            return
        key = tuple(int(t) for t in drafter_ids)
        meta = self._meta.get(key)
        if meta is None:
            return
        if which:
            meta.accepted += 1
        else:
            meta.proposed += 1
        meta.last_used = self._tick()
        self._deltas.setdefault(key, [0, 0])[which] += 1
        self._touch(key, meta)
        self._changed()

    # ---- writing

    def flush(self, attempts: int = _FLUSH_ATTEMPTS) -> bool:
        """Write pending changes as one transaction. Returns False when they stay pending (store
        busy past the retries, or a write error, reported once); never raises into the decode
        loop: the cache is an accelerator, losing a batch must not stop generation."""
        self._ops = 0
        if self.frozen or self._db is None or not (self._deltas or self._deleted):
            return True
        for attempt in range(attempts):
            try:
                self._write_batch()
                return True
            except sqlite3.Error as exc:
                if is_busy(exc) and attempt < attempts - 1:
                    continue
                if not is_busy(exc) and not self._warned_write:
                    self._warned_write = True
                    warn(f"n-gram cache {self.path}: write failed ({exc}); keeping changes in memory")
                return False
        return False

    def _write_batch(self) -> None:
        """BEGIN IMMEDIATE; delete evicted keys; merge our deltas into the stored rows; trim the
        store to the cap; COMMIT. Memory is updated only after the commit succeeded."""
        conn = self._db.conn
        with immediate_transaction(conn.select_one):
            for raw in self._deleted:
                conn.execute(f'DELETE FROM "{NGRAM_TABLE}" WHERE key = ?', (raw,))
            merged, inserted = self._merge(conn)
            conn.executemany(f'REPLACE INTO "{NGRAM_TABLE}" (key, value) VALUES (?, ?)',
                             [(encode_key(k), encode_value(m)) for k, m in merged.items()])
            # Only inserts grow the table, and every writer checks after its own inserts, so the
            # cap holds after every commit without counting rows in every batch.
            trimmed = self._trim_store(conn) if inserted else []
        for key, meta in merged.items():
            current = self._meta.get(key)
            if current is not None:
                current.proposed, current.accepted = meta.proposed, meta.accepted
                current.last_used = max(current.last_used, meta.last_used)
                self._clock = max(self._clock, current.last_used)
                self._touch(key, current)
        self._deltas.clear()
        self._deleted.clear()
        for key in trimmed:
            if key in self._meta:
                self._forget(key)
                self.evictions += 1

    def _merge(self, conn: Any) -> tuple[dict[Key, EntryMeta], bool]:
        """Rows to write: stored counts + our deltas (another writer's hits are kept), our target,
        the later last-use. A key missing on disk is written with our totals. Also returns whether
        any key is new on disk."""
        keys = [k for k in self._deltas if k in self._meta]
        stored: dict[str, str] = {}
        for i in range(0, len(keys), _IN_CHUNK):
            chunk = [encode_key(k) for k in keys[i:i + _IN_CHUNK]]
            marks = ",".join("?" * len(chunk))
            stored.update(conn.select(f'SELECT key, value FROM "{NGRAM_TABLE}" WHERE key IN ({marks})', tuple(chunk)))
        merged: dict[Key, EntryMeta] = {}
        inserted = False
        for key in keys:
            mine, (d_prop, d_acc) = self._meta[key], self._deltas[key]
            try:
                old = decode_value(stored[encode_key(key)])
            except (KeyError, ValueError):
                merged[key] = EntryMeta(mine.target, mine.proposed, mine.accepted, mine.last_used)
                inserted = True
                continue
            merged[key] = EntryMeta(mine.target, old.proposed + d_prop, old.accepted + d_acc,
                                    max(old.last_used, mine.last_used))
        return merged, inserted

    def _trim_store(self, conn: Any) -> list[Key]:
        """Keep the file within the cap even when other processes added entries we never saw."""
        if self.max_entries is None:
            return []
        count = conn.select_one(f'SELECT COUNT(*) FROM "{NGRAM_TABLE}"')[0]
        if count <= self.max_entries:
            return []
        rows = []
        for raw_key, raw_value in conn.select(f'SELECT key, value FROM "{NGRAM_TABLE}"'):
            try:
                rows.append((priority(decode_value(raw_value), self.policy), raw_key))
            except ValueError:
                rows.append(((-1,), raw_key))  # malformed rows go first
        rows.sort()
        victims = [raw for _, raw in rows[: count - self.max_entries]]
        for raw in victims:
            conn.execute(f'DELETE FROM "{NGRAM_TABLE}" WHERE key = ?', (raw,))
        out = []
        for raw in victims:
            try:
                out.append(decode_key(raw))
            except (ValueError, TypeError, AttributeError):
                pass  # a malformed row: nothing of it is in memory
        return out

    def clear(self) -> int:
        """Delete every entry, here and on disk, in one transaction. Returns how many were on
        disk. Shrinks the file afterwards when no other process is using it."""
        if self.frozen or self._db is None:
            raise OmnidraftError(f"n-gram cache {self.path} is read-only (frozen)")
        self.flush(attempts=_CLOSE_ATTEMPTS)  # so the count includes entries not written yet
        conn = self._db.conn
        with immediate_transaction(conn.select_one):
            count = conn.select_one(f'SELECT COUNT(*) FROM "{NGRAM_TABLE}"')[0]
            conn.execute(f'DELETE FROM "{NGRAM_TABLE}"')
        self.root, self._size = TrieNode(), 0
        self.version += 1
        self._meta.clear()
        self._deltas.clear()
        self._deleted.clear()
        self._queue.clear()
        for statement in ("VACUUM", "PRAGMA wal_checkpoint(TRUNCATE)"):
            try:
                conn.select_one(statement)
            except sqlite3.Error:
                pass  # another process has it open: the space is reused instead of returned
        return count

    def close(self) -> None:
        """Write what is pending (retrying harder than an automatic flush) and close the file."""
        if self._db is None:
            return
        try:
            self.flush(attempts=_CLOSE_ATTEMPTS)
        finally:
            db, self._db = self._db, None
            db.close()

    def __enter__(self) -> PersistentNgramCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- reporting

    def entry(self, drafter_ids: Sequence[int]) -> EntryMeta | None:
        """The stored metadata of one key (a copy), or None."""
        meta = self._meta.get(tuple(int(t) for t in drafter_ids))
        return None if meta is None else meta.copy()

    def entries(self) -> Iterator[tuple[Key, EntryMeta]]:
        """Every (drafter ids, metadata), in no particular order."""
        yield from self._meta.items()

    @property
    def pending(self) -> int:
        """How many keys wait for the next flush (changed or deleted)."""
        return len(self._deltas) + len(self._deleted)

    def memory_bytes(self) -> int:
        """Approximate bytes held in memory: trie nodes and their child dicts, plus metadata."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            total += sys.getsizeof(node) + sys.getsizeof(node.children)
            stack.extend(node.children.values())
        total += sys.getsizeof(self._meta)
        for key, meta in self._meta.items():
            total += sys.getsizeof(key) + sys.getsizeof(meta)
        return total

    def stats(self, top: int = 10) -> dict[str, Any]:
        """Numbers for ``omnidraft cache stats``; hit counts are lifetime totals from the store."""
        proposed = sum(m.proposed for m in self._meta.values())
        accepted = sum(m.accepted for m in self._meta.values())
        best = sorted(self._meta.items(), key=lambda kv: (-kv[1].accepted, -kv[1].proposed, kv[0]))[:max(top, 0)]
        return {
            "pair_id": self.pair_id,
            "path": str(self.path),
            "entries": len(self._meta),
            "bytes_on_disk": bytes_on_disk(self.path) if self.path.exists() else 0,
            "bytes_in_memory": self.memory_bytes(),
            "hits_proposed": proposed,
            "hits_accepted": accepted,
            "accept_rate": accepted / proposed if proposed else None,
            "skipped_rows": self.skipped_rows,
            "top": [
                {"drafter_ids": list(k), "target_id": m.target, "proposed": m.proposed, "accepted": m.accepted}
                for k, m in best
            ],
        }


def _close_at_exit(ref: weakref.ref) -> None:
    """Interpreter exit: write the last batch of a store nobody closed."""
    cache = ref()
    if cache is not None:
        try:
            cache.close()
        except Exception:  # noqa: BLE001 - never turn a clean exit into a traceback
            pass


def open_pair_cache(drafter_tokenizer: Any, target_tokenizer: Any, *, home: str | os.PathLike | None = None,
                    **kwargs: Any) -> PersistentNgramCache:
    """The store of a tokenizer pair at its default path; ``kwargs`` go to the constructor."""
    pair = pair_id(drafter_tokenizer, target_tokenizer)
    return PersistentNgramCache(default_store_path(pair, home), pair, **kwargs)


def fresh_store(folder: Path, slug: str, pair: str, *, max_entries: int | None = None,
                policy: str = "lru") -> PersistentNgramCache:
    """An empty writable store at ``folder/<slug>.sqlite`` (benchmarks: every cache starts from
    nothing). A previous run's store there is removed first; any other file in the way is refused."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{check_pair_id(slug)}{STORE_SUFFIX}"
    if path.exists():
        if not is_omnidraft_store(path):
            raise OmnidraftError(f"{path} is not an n-gram cache omnidraft wrote; move it away")
        for old in store_files(path):
            old.unlink()
    return PersistentNgramCache(path, pair, max_entries=max_entries, policy=policy)
