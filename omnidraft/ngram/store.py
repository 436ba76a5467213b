"""Persistent n-gram cache: the in-memory trie, loaded from and written back to a sqlitedict file.

The cache is what lets a drafter's sub-tokens ('f', 'la', 'ke') be proposed as the target's one
token ('flake'). It learns online, so it has to survive restarts, stay small on a phone and never
corrupt. Design (see ``cache_store/README.md`` for the on-disk format):

- One sqlite file per (drafter tokenizer, target tokenizer) pair, named by :func:`pair_id`, a
  stable hash of both vocabularies, and stamped with that id, so a cache is never used with the
  wrong pair. Tables use sqlitedict's layout (``key TEXT PRIMARY KEY, value BLOB``) with JSON
  values (never pickle: a cache file must not be able to run code when it is loaded).
- The decode loop talks to :class:`PersistentNgramCache`, a :class:`NgramTrie`, so lookups stay
  in memory; changes are written back in batches (every ``flush_every`` changes, and on close),
  each batch one sqlite transaction in WAL mode: a process killed at any moment leaves the old or
  the new state.
- A writer writes only the keys it changed, adding its *count deltas* to what is on disk, so two
  processes sharing one store merge instead of clobbering each other.
- Bounded size with LRU or LFU eviction, applied in memory and on disk in the same flush; or no
  cap; or ``frozen`` (read-only) for evaluation.
- A file sqlite cannot read ("corrupt") or that belongs to another pair or program ("foreign") is
  reported in one line on stderr and renamed aside, never deleted.

sqlitedict runs its connection on a worker thread and re-raises worker errors on the next call;
it cannot report a failed ``COMMIT`` issued through its own ``commit()`` (the worker dies and the
caller hangs), so batches are issued as plain ``BEGIN IMMEDIATE`` / ``COMMIT`` statements through
its connection, where errors come back to us. Its ``timeout`` argument is only the worker's
start-up wait; sqlite's lock wait is set with ``PRAGMA busy_timeout``.
"""

from __future__ import annotations

import atexit
import hashlib
import heapq
import json
import logging
import os
import re
import sqlite3
import sys
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sqlitedict import SqliteDict

from omnidraft.errors import OmnidraftError
from omnidraft.home import state_dir
from omnidraft.ngram.trie import NgramTrie, TrieNode

FORMAT_VERSION = 1
STORE_KIND = "omnidraft-ngram-cache"
NGRAM_TABLE = "ngrams"
META_TABLE = "meta"
META_KEY = "meta"
STORE_SUFFIX = ".sqlite"
SIDE_SUFFIXES = ("-wal", "-shm", "-journal")
POLICIES = ("lru", "lfu")
DEFAULT_BUSY_TIMEOUT_S = 1.0
_FLUSH_ATTEMPTS = 2  # automatic flushes: a busy store is retried at the next batch anyway
_CLOSE_ATTEMPTS = 8  # the last flush has no next batch; opening has no fallback either
_IN_CHUNK = 500  # bound parameters per SELECT ... IN (...), below sqlite's oldest limit (999)
_PAIR_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

Policy = Literal["lru", "lfu"]
Key = tuple[int, ...]

# Every sqlitedict error is re-raised to this module and handled here; its own multi-line ERROR
# logs would only duplicate them on stderr (and break the one-line rule for a bad cache file).
_sqlitedict_log = logging.getLogger("sqlitedict")
_sqlitedict_log.addHandler(logging.NullHandler())
_sqlitedict_log.propagate = False


@dataclass(slots=True)
class EntryMeta:
    """What the store keeps per n-gram besides the key: the target and its use statistics."""

    target: int
    proposed: int = 0
    accepted: int = 0
    last_used: int = 0  # microseconds since the epoch, made strictly increasing per process


class StoreProblem(Exception):
    """A store file that must not be used: ``kind`` is 'corrupt' or 'foreign'."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = " ".join(detail.split())  # keep the report on one line


# ---------------------------------------------------------------- pair identity and paths


def vocab_fingerprint(tokenizer: Any) -> str:
    cached = getattr(tokenizer, "_omnidraft_vocab_fingerprint", None)
    if cached is None:
        cached = _vocab_fingerprint(tokenizer)
        try:
            tokenizer._omnidraft_vocab_fingerprint = cached  # the vocabulary of a loaded tokenizer never changes
        except AttributeError:
            pass
    return cached


def _vocab_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) of a tokenizer's vocabulary plus its special/added tokens.

    Sorted by id then token, so dict order does not matter; any change of a token, an id or a
    special token changes the fingerprint, which is what makes a cache safe to reuse.
    """
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    for token, idx in sorted(vocab.items(), key=lambda kv: (int(kv[1]), kv[0])):
        h.update(f"{int(idx)}\t{token}\n".encode("utf-8", "surrogatepass"))
    specials = sorted(set(getattr(tokenizer, "all_special_tokens", None) or []))
    get_added = getattr(tokenizer, "get_added_vocab", None)
    added = sorted((str(k), int(v)) for k, v in get_added().items()) if callable(get_added) else []
    h.update(json.dumps({"special": specials, "added": added}, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def pair_id(drafter_tokenizer: Any, target_tokenizer: Any) -> str:
    """Stable id of a (drafter, target) tokenizer pair: ``<drafter 12 hex>-<target 12 hex>``.

    Order matters: the cache maps drafter sequences to target tokens, not the other way round.
    """
    return f"{vocab_fingerprint(drafter_tokenizer)[:12]}-{vocab_fingerprint(target_tokenizer)[:12]}"


def check_pair_id(value: str) -> str:
    """Return ``value`` if it is usable as a store file name, else raise ValueError."""
    if not _PAIR_ID_RE.match(value):
        raise ValueError(f"invalid cache pair id {value!r}: use letters, digits, '-', '_' or '.'")
    return value


def default_store_path(pair: str, home: str | os.PathLike | None = None) -> Path:
    """Where the cache of ``pair`` lives: ``<home>/cache_store/<pair>.sqlite``."""
    return state_dir("cache_store", home) / f"{check_pair_id(pair)}{STORE_SUFFIX}"


def list_store_paths(home: str | os.PathLike | None = None) -> list[Path]:
    """Every store file under the home's cache_store/ (files set aside are not listed)."""
    return sorted(p for p in state_dir("cache_store", home).glob(f"*{STORE_SUFFIX}") if p.is_file())


def store_files(path: Path) -> list[Path]:
    """The store file and the sqlite side files (WAL, shared memory, journal) that exist."""
    return [p for p in [path, *(Path(f"{path}{s}") for s in SIDE_SUFFIXES)] if p.exists()]


def bytes_on_disk(path: Path) -> int:
    """Size of the store including its side files (the WAL holds recent commits)."""
    return sum(p.stat().st_size for p in store_files(path))


# ---------------------------------------------------------------- encoding


def encode_key(drafter_ids: Iterable[int]) -> str:
    """Drafter id tuple -> compact text key, e.g. (12, 345, 6) -> '12,345,6'."""
    return ",".join(str(int(t)) for t in drafter_ids)


def decode_key(text: str) -> Key:
    """Inverse of :func:`encode_key`; raises ValueError unless it is >= 2 non-negative ints."""
    parts = text.split(",")
    if len(parts) < 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"malformed n-gram key {text!r}")
    return tuple(int(p) for p in parts)


def encode_value(meta: EntryMeta) -> str:
    """Entry -> JSON array ``[target, proposed, accepted, last_used]``."""
    return json.dumps([meta.target, meta.proposed, meta.accepted, meta.last_used], separators=(",", ":"))


def decode_value(raw: str | bytes) -> EntryMeta:
    """Inverse of :func:`encode_value`; raises ValueError on anything else."""
    try:
        value = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed n-gram value {raw!r}") from exc
    if not (isinstance(value, list) and len(value) == 4):
        raise ValueError(f"malformed n-gram value {raw!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(f"malformed n-gram value {raw!r}")
    return EntryMeta(*value)


# ---------------------------------------------------------------- sqlite error classes


def _errorname(exc: BaseException) -> str:
    return str(getattr(exc, "sqlite_errorname", ""))


def is_busy(exc: BaseException) -> bool:
    """Another process holds the lock: wait or retry, never treat the file as bad."""
    msg = str(exc).lower()
    return _errorname(exc).startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in msg or "busy" in msg


def _is_corruption(exc: BaseException) -> bool:
    """sqlite says the bytes are not a (sound) database."""
    name = _errorname(exc)
    if name:
        return name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT"))
    msg = str(exc).lower()
    return "not a database" in msg or "malformed" in msg or "corrupt" in msg


# ---------------------------------------------------------------- file checks (plain sqlite3)


def _connect(path: Path, busy_timeout: float) -> sqlite3.Connection:
    """A short-lived connection in autocommit mode, so transactions are explicit."""
    return sqlite3.connect(str(path), timeout=busy_timeout, isolation_level=None)


def _read_meta(con: sqlite3.Connection) -> dict | None:
    row = con.execute(f'SELECT value FROM "{META_TABLE}" WHERE key = ?', (META_KEY,)).fetchone()
    if row is None:
        return None
    try:
        meta = json.loads(row[0])
    except (TypeError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _check_meta(meta: dict | None, expected_pair: str) -> None:
    """Raise StoreProblem unless ``meta`` is our metadata record for ``expected_pair``."""
    if meta is None:
        raise StoreProblem("foreign", "it has no omnidraft metadata record")
    if meta.get("kind") != STORE_KIND:
        raise StoreProblem("foreign", "it is not an omnidraft n-gram cache")
    version = meta.get("format")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise StoreProblem("foreign", f"format {version!r} is not readable by this omnidraft (reads <= {FORMAT_VERSION})")
    if meta.get("pair_id") != expected_pair:
        raise StoreProblem("foreign", f"it belongs to tokenizer pair {meta.get('pair_id')!r}, not {expected_pair!r}")


def inspect_store(path: Path, expected_pair: str, busy_timeout: float = DEFAULT_BUSY_TIMEOUT_S) -> bool:
    """Check a store file before use. Returns False if there is nothing to load yet.

    Raises StoreProblem for a corrupt or foreign file, sqlite3.OperationalError when it is only
    busy (the caller retries) and OmnidraftError for an unreadable path (permissions...), which
    must not be set aside as if its bytes were bad.
    """
    if not path.exists():
        return False
    try:
        con = _connect(path, busy_timeout)
    except sqlite3.Error as exc:
        raise OmnidraftError(f"cannot open n-gram cache {path}: {exc}") from exc
    try:
        check = con.execute("PRAGMA quick_check").fetchall()
        if check != [("ok",)]:
            raise StoreProblem("corrupt", f"integrity check failed: {check[0][0] if check else 'no answer'}")
        tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if META_TABLE not in tables:
            rows = con.execute(f'SELECT COUNT(*) FROM "{NGRAM_TABLE}"').fetchone()[0] if NGRAM_TABLE in tables else 0
            if tables - {NGRAM_TABLE} or rows:
                raise StoreProblem("foreign", "it has no omnidraft metadata record")
            return False  # an empty database (e.g. a creator killed before its first commit)
        _check_meta(_read_meta(con), expected_pair)
        if NGRAM_TABLE not in tables:
            raise StoreProblem("corrupt", f"the {NGRAM_TABLE!r} table is missing")
        return True
    except sqlite3.DatabaseError as exc:
        if is_busy(exc):
            raise
        if _is_corruption(exc):
            raise StoreProblem("corrupt", str(exc)) from exc
        raise OmnidraftError(f"cannot read n-gram cache {path}: {exc}") from exc
    finally:
        con.close()


def initialize_store(path: Path, pair: str, busy_timeout: float = DEFAULT_BUSY_TIMEOUT_S) -> None:
    """Create the tables and the metadata record, in WAL mode, in one transaction (idempotent).

    Re-checks the metadata inside the write lock, so two processes creating one store race safely.
    """
    con = _connect(path, busy_timeout)
    try:
        con.execute("PRAGMA journal_mode = WAL")
        con.execute("BEGIN IMMEDIATE")
        try:
            for table in (META_TABLE, NGRAM_TABLE):
                con.execute(f'CREATE TABLE IF NOT EXISTS "{table}" (key TEXT PRIMARY KEY, value BLOB)')
            meta = _read_meta(con)
            if meta is None:
                record = {"kind": STORE_KIND, "format": FORMAT_VERSION, "pair_id": pair, "created": time.time()}
                con.execute(f'INSERT INTO "{META_TABLE}" (key, value) VALUES (?, ?)', (META_KEY, json.dumps(record)))
            else:
                _check_meta(meta, pair)
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    finally:
        con.close()


def set_aside(path: Path, kind: str) -> Path | None:
    """Rename a bad store (and its side files, so an old WAL is never replayed into a new store)
    to ``<name>.<kind>-<timestamp>``. Returns the new path, or None if another process already
    moved it."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    target = path.with_name(f"{path.name}.{kind}-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.{kind}-{stamp}-{n}")
        n += 1
    try:
        os.replace(path, target)
    except FileNotFoundError:
        return None
    for suffix in SIDE_SUFFIXES:
        side = Path(f"{path}{suffix}")
        if side.exists():
            try:
                os.replace(side, Path(f"{target}{suffix}"))
            except FileNotFoundError:
                pass
    return target


def _warn(message: str) -> None:
    print(f"omnidraft: warning: {' '.join(message.split())}", file=sys.stderr, flush=True)


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
            raise ValueError(f"unknown cache policy {policy!r}; expected one of {POLICIES}")
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
        # Bumped on every change of the key set or a target, so a consumer that caches something
        # derived from the trie (e.g. the drafter's root-token mask) can tell it is stale; len()
        # cannot, since an add that evicts leaves it unchanged.
        self.version = 0
        self._meta: dict[Key, EntryMeta] = {}
        self._deltas: dict[Key, list[int]] = {}  # key -> [proposed, accepted] since the last flush
        self._deleted: set[str] = set()  # encoded keys to delete at the next flush
        self._heap: list[tuple[tuple[int, ...], Key]] = []  # lazy eviction queue (bounded only)
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
        if self.frozen:
            self.problem = f"n-gram cache {self.path} is {problem.kind} ({problem.detail}); ignoring it (read-only)"
        else:
            aside = set_aside(self.path, problem.kind)
            where = f"moved it aside to {aside.name}" if aside else "another process moved it aside"
            self.problem = f"n-gram cache {self.path} is {problem.kind} ({problem.detail}); {where} and starting empty"
        _warn(self.problem)

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
            self._rebuild_heap()
            while len(self._meta) > self.max_entries:
                self._evict_one(exclude=None)

    # ---- eviction bookkeeping

    def _priority(self, meta: EntryMeta) -> tuple[int, ...]:
        """Smallest is evicted first: LRU by last use; LFU by total hits, then last use."""
        if self.policy == "lfu":
            return (meta.proposed + meta.accepted, meta.last_used)
        return (meta.last_used,)

    def _touch(self, key: Key, meta: EntryMeta) -> None:
        if self.max_entries is None:
            return
        heapq.heappush(self._heap, (self._priority(meta), key))
        if len(self._heap) > 2 * len(self._meta) + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(self._priority(m), k) for k, m in self._meta.items()]
        heapq.heapify(self._heap)

    def _victim(self, exclude: Key | None) -> Key | None:
        """Pop stale heap items until the top is a live key at its current priority."""
        held: list[tuple[tuple[int, ...], Key]] = []
        victim = None
        while self._heap:
            prio, key = heapq.heappop(self._heap)
            meta = self._meta.get(key)
            if meta is None or self._priority(meta) != prio:
                continue
            if key == exclude:
                held.append((prio, key))
                continue
            victim = key
            break
        for item in held:
            heapq.heappush(self._heap, item)
        return victim

    def _evict_one(self, exclude: Key | None) -> None:
        key = self._victim(exclude)
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
        self.version += 1

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
            self.version += 1
        else:
            if meta.target != int(target_id):
                self.version += 1
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
                    _warn(f"n-gram cache {self.path}: write failed ({exc}); keeping changes in memory")
                return False
        return False

    def _write_batch(self) -> None:
        """BEGIN IMMEDIATE; delete evicted keys; merge our deltas into the stored rows; trim the
        store to the cap; COMMIT. Memory is updated only after the commit succeeded."""
        conn = self._db.conn
        conn.select_one("BEGIN IMMEDIATE")
        try:
            for raw in self._deleted:
                conn.execute(f'DELETE FROM "{NGRAM_TABLE}" WHERE key = ?', (raw,))
            merged, inserted = self._merge(conn)
            conn.executemany(f'REPLACE INTO "{NGRAM_TABLE}" (key, value) VALUES (?, ?)',
                             [(encode_key(k), encode_value(m)) for k, m in merged.items()])
            # Only inserts grow the table, and every writer checks after its own inserts, so the
            # cap holds after every commit without counting rows in every batch.
            trimmed = self._trim_store(conn) if inserted else []
            conn.select_one("COMMIT")
        except BaseException:
            try:
                conn.select_one("ROLLBACK")
            except sqlite3.Error:
                pass  # no transaction left to roll back
            raise
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
                rows.append((self._priority(decode_value(raw_value)), raw_key))
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
        conn.select_one("BEGIN IMMEDIATE")
        try:
            count = conn.select_one(f'SELECT COUNT(*) FROM "{NGRAM_TABLE}"')[0]
            conn.execute(f'DELETE FROM "{NGRAM_TABLE}"')
            conn.select_one("COMMIT")
        except BaseException:
            try:
                conn.select_one("ROLLBACK")
            except sqlite3.Error:
                pass
            raise
        self.root, self._size = TrieNode(), 0
        self.version += 1
        self._meta.clear()
        self._deltas.clear()
        self._deleted.clear()
        self._heap.clear()
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
        return None if meta is None else EntryMeta(meta.target, meta.proposed, meta.accepted, meta.last_used)

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
