"""Drafting from what was said before: a persistent index of the target's past outputs.

:class:`~omnidraft.sources.lookup.LookupIndex` copies from the current context only. A user who
asks the same or a similar thing again (a script re-run, an answer regenerated, a chat restarted)
gets text the target already wrote in an earlier request or process; this index keeps it. It maps
the last n target ids (n in ``ORDERS``, longest first) to the up to ``CONTINUATION`` ids that
followed them the last time, so a proposal is at most ``len(ORDERS)`` dictionary probes. The
decoder verifies a history proposal like any lookup draft, so the output does not change; a stale
or wrong continuation costs one verification step.

One sqlite file per target tokenizer, ``<home>/cache_store/lookup-<fingerprint[:16]>.sqlite3``,
stamped with the tokenizer's vocabulary fingerprint in a meta row (token ids mean nothing under
another vocabulary); its layout and checks are in ``ngram/files.py``. It is read whole at open;
:meth:`LookupHistory.save` writes the entries changed since (and deletes the evicted ones) in one
transaction, so a process killed mid-write leaves the old or the new state (sqlite's rollback
journal, rolled back by the next writer). Two processes sharing the file: the last writer wins per
entry, which is fine for a cache. A corrupt or foreign file is moved aside with one line on stderr
and the history starts empty.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnidraft.config import DecodeConfig
from omnidraft.console import warn
from omnidraft.ngram.files import (
    DEFAULT_BUSY_TIMEOUT_S,
    HISTORY_FORMAT,
    HISTORY_KIND,
    HISTORY_TABLE,
    META_KEY,
    META_TABLE,
    StoreProblem,
    check_history,
    connect,
    connect_read_only,
    decode_key,
    encode_key,
    history_path,
    immediate_transaction,
    is_busy,
    is_corruption,
    report_problem,
)
from omnidraft.sources.base import Offer, Parts, StepResult, StepTimes, lookup_applies
from omnidraft.sources.lookup import LONG_MATCH, LOOKUP_MAX, match_key, match_prior
from omnidraft.verify.proposal import Proposal
from omnidraft.identity import vocab_fingerprint

if TYPE_CHECKING:
    from omnidraft.sources.policy import SourcePolicy

# n-gram lengths tried, longest first: 2 repeats too often by chance to be worth a step. A match of
# LONG_MATCH is a copy of an earlier text in progress (a repeated request, a regenerated answer): its
# policy key starts from the long-match prior, as prompt lookup's does, so it drafts long at once where
# a verified row costs (llama.cpp); a 4-gram's even prior kept such a copy at 3 proposals a step there,
# and on torch it lost to the drafter before it was ever tried
ORDERS = (LONG_MATCH, 4, 3)
CONTINUATION = LOOKUP_MAX  # ids kept after each n-gram (as many as a lookup draft copies; the policy cuts it)
PROMPT_TAIL = max(ORDERS)  # prompt ids recorded before an output, so its first tokens are indexed too
DEFAULT_MAX_ENTRIES = 300_000  # ~3 entries per output token: the last ~100k tokens, ~100 MB in memory

_ITEM = array("I").itemsize


def _pack(ids: Sequence[int]) -> bytes:
    """Ids as packed unsigned ints: a key or continuation in ~1/4 of a tuple's memory."""
    return array("I", ids).tobytes()


def _unpack(raw: bytes) -> list[int]:
    out = array("I")
    out.frombytes(raw)
    return out.tolist()


def _parse_ids(text: Any) -> list[int]:
    """A stored continuation, ``'12,345,6'`` (1 to CONTINUATION ids); ValueError otherwise."""
    parts = text.split(",") if isinstance(text, str) else []
    if not 1 <= len(parts) <= CONTINUATION or not all(p.isdigit() for p in parts):
        raise ValueError(f"malformed continuation {text!r}")
    return [int(p) for p in parts]


@dataclass(slots=True)
class HistoryEntry:
    """What followed one n-gram last time, and its use for eviction and statistics."""

    continuation: bytes  # packed ids (see _pack)
    last_used: int  # microseconds since the epoch, strictly increasing per process (LRU order)
    hits: int = 0  # proposals made from it


class LookupHistory:
    """n-gram of target ids -> what followed it in earlier outputs (see the module docstring).

    Single-threaded: the decoder owns it. ``read_only``: proposes, never records, writes or moves
    the file (``--freeze-cache``). Eviction is LRU through the OrderedDict's order rather than
    ``ngram/eviction.py``'s heap: that queue is built around the pair cache's per-key counters,
    while here order of use is all that is needed and ``move_to_end``/``popitem`` keep it exactly,
    in O(1), with no stale heap items.
    """

    def __init__(self, path: str | os.PathLike, fingerprint: str, *, max_entries: int = DEFAULT_MAX_ENTRIES,
                 read_only: bool = False, busy_timeout: float = DEFAULT_BUSY_TIMEOUT_S) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        if not fingerprint:
            raise ValueError("a lookup history needs the target's vocabulary fingerprint")
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.max_entries = max_entries
        self.read_only = read_only
        self.busy_timeout = busy_timeout
        self.problem: str | None = None  # set when the file was corrupt/foreign and not used
        self.skipped_rows = 0  # malformed rows seen at load (not loaded; deleted by the next save)
        self.evictions = 0
        self._entries: OrderedDict[bytes, HistoryEntry] = OrderedDict()  # least recently used first
        self._dirty: set[bytes] = set()  # keys to write at the next save
        self._deleted: set[str] = set()  # encoded keys to delete at the next save
        self._clock = 0
        self._warned = False
        self._load()

    def __len__(self) -> int:
        return len(self._entries)

    # ---- drafting and learning

    def propose(self, context_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` ids that followed the context's last n ids last time, for the longest n in
        ``ORDERS`` that was seen; [] when none was."""
        return self.propose_match(context_ids, k)[0]

    def propose_match(self, context_ids: Sequence[int], k: int) -> tuple[list[int], int]:
        """(``propose``'s ids, the n that matched; 0 without a match)."""
        if k <= 0:
            return [], 0
        for n in ORDERS:
            if len(context_ids) < n:
                continue
            key = _pack(context_ids[-n:])
            entry = self._entries.get(key)
            if entry is not None:
                entry.hits += 1
                self._use(key, entry)
                return _unpack(entry.continuation[: k * _ITEM]), n
        return [], 0

    def record(self, token_ids: Sequence[int]) -> None:
        """Index a finished text (the prompt's last ``PROMPT_TAIL`` ids + the output): every
        position's n-grams -> the next up to ``CONTINUATION`` ids. Once per request, not per step."""
        if self.read_only:
            return
        ids = [int(t) for t in token_ids]
        for end in range(min(ORDERS), len(ids)):
            continuation = _pack(ids[end: end + CONTINUATION])  # one object shared by both orders
            for n in ORDERS:
                if end >= n:
                    self._put(_pack(ids[end - n: end]), continuation)
        while len(self._entries) > self.max_entries:
            key, _ = self._entries.popitem(last=False)
            self._dirty.discard(key)
            self._deleted.add(self._encode(key))
            self.evictions += 1

    def _put(self, key: bytes, continuation: bytes) -> None:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = HistoryEntry(continuation, 0)
        elif not entry.continuation.startswith(continuation):  # a prefix of what is kept (an output cut short) adds nothing
            entry.continuation = continuation
        self._use(key, entry)
        if self._deleted:  # evicted earlier in this session and back now: written, not deleted
            self._deleted.discard(self._encode(key))

    def _use(self, key: bytes, entry: HistoryEntry) -> None:
        entry.last_used = self._tick()
        self._entries.move_to_end(key)
        self._dirty.add(key)

    def _tick(self) -> int:
        """Wall-clock microseconds, strictly increasing here, so LRU order is exact in this process
        and roughly comparable with other processes' stamps in the shared file."""
        self._clock = max(self._clock + 1, time.time_ns() // 1000)
        return self._clock

    @staticmethod
    def _encode(key: bytes) -> str:
        return encode_key(_unpack(key))

    # ---- the file

    def _load(self) -> None:
        """Read every entry, oldest first; a bad file is reported and set aside (or, read-only,
        ignored); an unreadable one (busy, permissions) is left alone and the history starts empty."""
        if not self.path.exists():
            return
        try:
            con = connect_read_only(self.path, self.busy_timeout) if self.read_only else connect(self.path, self.busy_timeout)
            try:
                rows = self._read(con)
            finally:
                con.close()
        except StoreProblem as problem:
            self._report(problem)
            return
        except sqlite3.DatabaseError as exc:
            if is_corruption(exc):
                self._report(StoreProblem("corrupt", str(exc)))
            else:
                warn(f"cannot read lookup history {self.path} ({exc}); starting without it")
            return
        loaded = []
        for raw_key, raw_continuation, last_used, hits in rows:
            try:
                ids = decode_key(raw_key) if isinstance(raw_key, str) else ()
                if len(ids) not in ORDERS or not all(isinstance(v, int) and v >= 0 for v in (last_used, hits)):
                    raise ValueError("malformed row")
                loaded.append((last_used, _pack(ids), HistoryEntry(_pack(_parse_ids(raw_continuation)), last_used, hits)))
            except (ValueError, OverflowError):  # OverflowError: an id beyond 32 bits
                self.skipped_rows += 1
                if isinstance(raw_key, str):
                    self._deleted.add(raw_key)
        loaded.sort(key=lambda row: row[0])
        for last_used, key, entry in loaded:
            self._entries[key] = entry
            self._clock = max(self._clock, last_used)
        while len(self._entries) > self.max_entries:  # a smaller cap than the file was written with
            key, _ = self._entries.popitem(last=False)
            self._deleted.add(self._encode(key))
            self.evictions += 1

    def _read(self, con: sqlite3.Connection) -> list[tuple]:
        if not check_history(con, self.fingerprint):
            return []
        return con.execute(f'SELECT key, continuation, last_used, hits FROM "{HISTORY_TABLE}"').fetchall()

    def _report(self, problem: StoreProblem) -> None:
        """One line on stderr; the file is moved aside (writable) or ignored (read-only)."""
        self.problem = report_problem("lookup history", self.path, problem, self.read_only)

    def save(self) -> bool:
        """Write what changed since the last save as one transaction. Returns False when it stays
        pending (the file busy past the timeout, or a write error, reported once); never raises
        for the file: the history is an accelerator, losing it must not stop generation."""
        if self.read_only or not (self._dirty or self._deleted):
            return True
        for attempt in range(2):
            try:
                self._write()
                return True
            except (StoreProblem, sqlite3.DatabaseError) as exc:
                problem = exc if isinstance(exc, StoreProblem) else (
                    StoreProblem("corrupt", str(exc)) if is_corruption(exc) else None)
                if problem is not None and attempt == 0:  # the file went bad since we read it
                    self._report(problem)
                    self._dirty, self._deleted = set(self._entries), set()  # all of it goes to the new file
                    continue
                if isinstance(exc, sqlite3.DatabaseError) and is_busy(exc):
                    return False  # kept for the next save
                self._warn_once(exc)
                return False
            except (OSError, sqlite3.Error) as exc:
                self._warn_once(exc)
                return False
        return False

    def _warn_once(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            warn(f"lookup history {self.path}: write failed ({exc}); keeping it in memory")

    def _write(self) -> None:
        """BEGIN IMMEDIATE; create or check the file; delete, replace, trim to the cap; COMMIT.
        Memory forgets what is pending only after the commit."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = connect(self.path, self.busy_timeout)
        try:
            with immediate_transaction(con.execute):
                self._prepare(con)
                con.executemany(f'DELETE FROM "{HISTORY_TABLE}" WHERE key = ?', [(k,) for k in self._deleted])
                rows = [(self._encode(k), encode_key(_unpack(e.continuation)), e.last_used, e.hits)
                        for k, e in ((k, self._entries[k]) for k in self._dirty if k in self._entries)]
                con.executemany(f'REPLACE INTO "{HISTORY_TABLE}" (key, continuation, last_used, hits) '
                                'VALUES (?, ?, ?, ?)', rows)
                trimmed = self._trim(con)
        finally:
            con.close()
        self._dirty.clear()
        self._deleted.clear()
        for raw in trimmed:
            try:
                key = _pack(decode_key(raw))
            except (ValueError, OverflowError):
                continue  # a malformed row: nothing of it is in memory
            if self._entries.pop(key, None) is not None:
                self.evictions += 1

    def _prepare(self, con: sqlite3.Connection) -> None:
        """Inside the write lock: a new file gets its tables and meta row; an existing one is
        checked again (another process may have replaced it since we read it)."""
        if check_history(con, self.fingerprint):
            return
        con.execute(f'CREATE TABLE IF NOT EXISTS "{META_TABLE}" (key TEXT PRIMARY KEY, value BLOB)')
        con.execute(f'CREATE TABLE IF NOT EXISTS "{HISTORY_TABLE}" (key TEXT PRIMARY KEY, '
                    'continuation TEXT NOT NULL, last_used INTEGER NOT NULL, hits INTEGER NOT NULL)')
        meta = {"kind": HISTORY_KIND, "format": HISTORY_FORMAT, "target": self.fingerprint, "created": time.time()}
        con.execute(f'INSERT INTO "{META_TABLE}" (key, value) VALUES (?, ?)', (META_KEY, json.dumps(meta)))

    def _trim(self, con: sqlite3.Connection) -> list[str]:
        """Keep the file within the cap even when other processes added entries we never saw;
        returns the keys deleted (least recently used first)."""
        count = con.execute(f'SELECT COUNT(*) FROM "{HISTORY_TABLE}"').fetchone()[0]
        if count <= self.max_entries:
            return []
        victims = [k for (k,) in con.execute(f'SELECT key FROM "{HISTORY_TABLE}" ORDER BY last_used LIMIT ?',
                                              (count - self.max_entries,))]
        con.executemany(f'DELETE FROM "{HISTORY_TABLE}" WHERE key = ?', [(k,) for k in victims])
        return victims

    # ---- reporting

    def entry(self, ngram: Sequence[int]) -> tuple[list[int], int, int] | None:
        """(continuation, last_used, hits) stored for an n-gram, or None (tests, debugging)."""
        entry = self._entries.get(_pack(ngram))
        return None if entry is None else (_unpack(entry.continuation), entry.last_used, entry.hits)

    @property
    def pending(self) -> int:
        """How many keys wait for the next save (changed or deleted)."""
        return len(self._dirty) + len(self._deleted)


def open_history(target_tokenizer: Any, *, home: str | os.PathLike | None = None, **kwargs: Any) -> LookupHistory:
    """The history of a target tokenizer at its default path; ``kwargs`` go to the constructor."""
    fingerprint = vocab_fingerprint(target_tokenizer)
    return LookupHistory(history_path(fingerprint, home), fingerprint, **kwargs)


class HistoryLookup:
    """The draft source over earlier outputs: asked when the context has no match (free sources
    are weighed first match only), and each request's output is added to it at the end."""

    name, free = "history", True

    def __init__(self, parts: Parts, history: LookupHistory) -> None:
        self.parts, self.history = parts, history

    @classmethod
    def build(cls, parts: Parts) -> HistoryLookup | None:
        return cls(parts, parts.history) if parts.lookup and parts.history is not None else None

    def begin(self, ids: list[int], config: DecodeConfig, policy: SourcePolicy) -> bool:
        return lookup_applies(self.parts, config)

    def offer(self, ids: list[int], room: int) -> Offer | None:
        copied, matched = self.history.propose_match(ids, min(LOOKUP_MAX, room))
        return Offer(match_key(self.name, matched), len(copied), copied, prior=match_prior(matched)) if copied else None

    def draft(self, ids: list[int], offer: Offer, k: int, times: StepTimes) -> Proposal:
        return Proposal(offer.ids[:k])

    def accept(self, step: StepResult) -> None:
        pass

    def finish(self, prompt_len: int, ids: list[int]) -> None:
        """Add the output (after the prompt's last ids, so its first tokens can be found from
        them) to the history and write it; a failure is one line, never a failed request."""
        try:
            self.history.record(ids[max(prompt_len - PROMPT_TAIL, 0):])
            self.history.save()
        except Exception as exc:  # noqa: BLE001 - the history only accelerates; the output is already out
            warn(f"the lookup history was not updated: {exc}")
