"""The n-gram cache on disk: file layout, encoding, checks before use, and setting bad files aside.

One sqlite file per (drafter tokenizer, target tokenizer) pair, named by the pair id and stamped
with it in a metadata record, so a cache is never used with the wrong pair. Tables use
sqlitedict's layout (``key TEXT PRIMARY KEY, value BLOB``) with JSON values (never pickle: a cache
file must not be able to run code when it is loaded). See ``cache_store/README.md``.

A file sqlite cannot read ("corrupt") or that belongs to another pair or program ("foreign") is
renamed aside with its side files, never deleted and never half-used.

The prompt-lookup history (``sources/history.py``) lives in the same folder, one file per target
tokenizer named ``lookup-<target fingerprint[:16]>.sqlite3`` (not ``*.sqlite``: that glob means a
pair cache). Its layout and checks are here too, so that ``omnidraft cache`` lists and removes it
without importing the drafter (and torch).
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from omnidraft.console import warn
from omnidraft.errors import OmnidraftError
from omnidraft.home import home_dir
from omnidraft.identity import check_pair_id

FORMAT_VERSION = 1
STORE_KIND = "omnidraft-ngram-cache"
NGRAM_TABLE = "ngrams"
META_TABLE = "meta"
META_KEY = "meta"
STORE_SUFFIX = ".sqlite"
SIDE_SUFFIXES = ("-wal", "-shm", "-journal")
DEFAULT_BUSY_TIMEOUT_S = 1.0
LOOKUP_PREFIX = "lookup-"
HISTORY_SUFFIX = ".sqlite3"
HISTORY_KIND = "omnidraft-lookup-history"
HISTORY_FORMAT = 1
HISTORY_TABLE = "history"
_FINGERPRINT_RE = re.compile(r"^[0-9a-f]{16,64}$")

Key = tuple[int, ...]


@dataclass(slots=True)
class EntryMeta:
    """What the store keeps per n-gram besides the key: the target and its use statistics."""

    target: int
    proposed: int = 0
    accepted: int = 0
    last_used: int = 0  # microseconds since the epoch, made strictly increasing per process

    def copy(self) -> EntryMeta:
        return EntryMeta(self.target, self.proposed, self.accepted, self.last_used)


class StoreProblem(Exception):
    """A store file that must not be used: ``kind`` is 'corrupt' or 'foreign'."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = " ".join(detail.split())  # keep the report on one line


# ---------------------------------------------------------------- paths


def store_folder(home: str | os.PathLike | None = None) -> Path:
    """``<home>/cache_store`` (not created here: reading must leave the home untouched)."""
    return home_dir(home) / "cache_store"


def default_store_path(pair: str, home: str | os.PathLike | None = None) -> Path:
    """Where the cache of ``pair`` lives: ``<home>/cache_store/<pair>.sqlite``."""
    return store_folder(home) / f"{check_pair_id(pair)}{STORE_SUFFIX}"


def list_store_paths(home: str | os.PathLike | None = None, *, unusable: bool = False) -> list[Path]:
    """Every store file under the home's cache_store/ (files set aside are not listed).

    ``unusable`` also lists what is named like a store but is no file (a folder, a link to one):
    ``cache stats`` must report what would stop ``generate``, not say there is no cache."""
    folder = store_folder(home)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob(f"*{STORE_SUFFIX}") if p.is_file() or (unusable and p.exists()))


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


def is_corruption(exc: BaseException) -> bool:
    """sqlite says the bytes are not a (sound) database."""
    name = _errorname(exc)
    if name:
        return name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT"))
    msg = str(exc).lower()
    return "not a database" in msg or "malformed" in msg or "corrupt" in msg


# ---------------------------------------------------------------- checks (plain sqlite3)


def connect(path: Path, busy_timeout: float) -> sqlite3.Connection:
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
    busy (the caller retries) and OmnidraftError for an unreadable path (permissions, a folder),
    which must not be set aside as if its bytes were bad.
    """
    if not path.exists():
        return False
    if not path.is_file():
        raise OmnidraftError(f"n-gram cache {path} is not a file; move it away")
    try:
        con = connect(path, busy_timeout)
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
        if is_corruption(exc):
            raise StoreProblem("corrupt", str(exc)) from exc
        raise OmnidraftError(f"cannot read n-gram cache {path}: {exc}") from exc
    finally:
        con.close()


def is_omnidraft_store(path: Path) -> bool:
    """Whether ``path`` carries our metadata record (for any pair): safe for omnidraft to replace."""
    try:
        con = connect(path, DEFAULT_BUSY_TIMEOUT_S)
        try:
            meta = _read_meta(con)
        finally:
            con.close()
    except sqlite3.Error:
        return False
    return bool(meta) and meta.get("kind") == STORE_KIND


def initialize_store(path: Path, pair: str, busy_timeout: float = DEFAULT_BUSY_TIMEOUT_S) -> None:
    """Create the tables and the metadata record, in WAL mode, in one transaction (idempotent).

    Re-checks the metadata inside the write lock, so two processes creating one store race safely.
    """
    con = connect(path, busy_timeout)
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


@contextmanager
def immediate_transaction(run: Callable[[str], object]) -> Iterator[None]:
    """BEGIN IMMEDIATE, the block, COMMIT, through ``run`` (a connection's statement runner). Any
    error rolls back and propagates; a failed ROLLBACK only means no transaction was left."""
    run("BEGIN IMMEDIATE")
    try:
        yield
        run("COMMIT")
    except BaseException:
        try:
            run("ROLLBACK")
        except sqlite3.Error:
            pass
        raise


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


def report_problem(what: str, path: Path, problem: StoreProblem, read_only: bool) -> str:
    """One line on stderr for a bad store file (``what``: "n-gram cache", "lookup history"), which
    is moved aside unless the opener only reads; returns the line."""
    if read_only:
        line = (f"{what} {path} is {problem.kind} ({problem.detail}); ignoring it (read-only here); "
                "a command that writes it moves it aside and starts empty")
    else:
        aside = set_aside(path, problem.kind)
        where = f"moved it aside to {aside.name}" if aside else "another process moved it aside"
        line = f"{what} {path} is {problem.kind} ({problem.detail}); {where} and starting empty"
    warn(line)
    return line


# ---------------------------------------------------------------- lookup history files


def history_path(fingerprint: str, home: str | os.PathLike | None = None) -> Path:
    """Where the lookup history of a target tokenizer (its vocabulary fingerprint, hex) lives."""
    if not _FINGERPRINT_RE.match(fingerprint):
        raise ValueError(f"invalid vocabulary fingerprint {fingerprint!r}: expected 16 to 64 hex digits")
    return store_folder(home) / f"{LOOKUP_PREFIX}{fingerprint[:16]}{HISTORY_SUFFIX}"


def list_history_paths(home: str | os.PathLike | None = None) -> list[Path]:
    """The lookup history files under the home's cache_store/ by name (links are not followed:
    omnidraft never makes one). Whether one really is a history is :func:`describe_history`'s to say."""
    folder = store_folder(home)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob(f"{LOOKUP_PREFIX}*{HISTORY_SUFFIX}") if p.is_file() and not p.is_symlink())


def connect_read_only(path: Path, busy_timeout: float) -> sqlite3.Connection:
    """A connection that cannot write or create anything (no file, no journal)."""
    return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=busy_timeout, isolation_level=None)


def check_history(con: sqlite3.Connection, fingerprint: str | None) -> bool:
    """Raise StoreProblem unless ``con`` is a lookup history (of the target ``fingerprint``, any
    when None). False: an empty database (a first writer killed before its commit), nothing to read."""
    tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables:
        return False
    meta = _read_meta(con) if META_TABLE in tables else None
    if not meta or meta.get("kind") != HISTORY_KIND:
        raise StoreProblem("foreign", "it is not an omnidraft lookup history")
    version = meta.get("format")
    if not isinstance(version, int) or version > HISTORY_FORMAT:
        raise StoreProblem("foreign", f"format {version!r} is not readable by this omnidraft (reads <= {HISTORY_FORMAT})")
    if fingerprint is not None and meta.get("target") != fingerprint:
        theirs = str(meta.get("target"))[:16]
        raise StoreProblem("foreign", f"it belongs to target tokenizer {theirs!r}, not {fingerprint[:16]!r}")
    if HISTORY_TABLE not in tables:
        raise StoreProblem("corrupt", f"the {HISTORY_TABLE!r} table is missing")
    return True


def describe_history(path: Path, busy_timeout: float = DEFAULT_BUSY_TIMEOUT_S) -> dict:
    """Path, target fingerprint (None: an empty database), entries and bytes of a lookup history,
    read without writing anything. Raises StoreProblem (corrupt, foreign) or sqlite3.Error."""
    con = connect_read_only(path, busy_timeout)
    try:
        if check_history(con, None):
            target = str(_read_meta(con)["target"])
            entries = con.execute(f'SELECT COUNT(*) FROM "{HISTORY_TABLE}"').fetchone()[0]
        else:
            target, entries = None, 0
    except sqlite3.DatabaseError as exc:
        if is_corruption(exc):
            raise StoreProblem("corrupt", str(exc)) from exc
        raise
    finally:
        con.close()
    return {"path": str(path), "target": target, "entries": entries, "bytes_on_disk": bytes_on_disk(path)}


def remove_history(path: Path) -> int:
    """Delete a lookup history and its side files, only after its metadata record shows omnidraft
    wrote it (a delete command must never touch anything else). Returns the entries it held.
    Raises StoreProblem (touching nothing) for any file that is not verifiably one."""
    if (path.is_symlink() or not path.is_file() or not path.name.startswith(LOOKUP_PREFIX)
            or not path.name.endswith(HISTORY_SUFFIX)):
        raise StoreProblem("foreign", "it is not a lookup history file")
    try:
        info = describe_history(path)
    except sqlite3.Error as exc:
        raise StoreProblem("unreadable", str(exc)) from exc
    if info["target"] is None:
        raise StoreProblem("foreign", "it has no omnidraft metadata record")
    for p in store_files(path):
        p.unlink(missing_ok=True)
    return info["entries"]
