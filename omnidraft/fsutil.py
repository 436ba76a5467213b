"""Files that never end half-written, and locks that die with their owner.

Every file omnidraft writes for a user (results, exports, transcripts, adapter metadata, the
``CURRENT`` pointer) goes through :func:`atomic_write`: a temporary sibling, flushed and fsynced,
renamed over the target, and the directory fsynced, so a process killed at any moment leaves the
old file or the new one. :class:`FileLock` is an ``flock`` on a lock file that also names its
owner: the kernel drops the lock when the owner dies, so there is no stale lock to clean up, and a
second writer is told who holds it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from omnidraft.errors import OmnidraftError


def file_version_key(path: Path) -> str:
    """A name for this version of a file: its resolved path, size and mtime, hashed. A memo of
    what was derived from the file, kept under this name, goes stale when the file is replaced."""
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:24]


def file_memo(source: Path, memo_dir: Path | None, keys: Sequence[str], compute: Callable[[], dict]) -> dict:
    """What ``compute()`` derives from ``source`` (slow to derive, small to keep), kept as JSON in
    ``memo_dir`` per version of the file. A memo that is missing, unreadable or lacks one of ``keys``
    is computed again and rewritten atomically; with no ``memo_dir``, or a home that cannot be
    written, it is computed each time."""
    memo = memo_dir / f"{file_version_key(source)}.json" if memo_dir is not None else None
    if memo is not None:
        try:
            doc = json.loads(memo.read_text())
            if isinstance(doc, dict) and all(key in doc for key in keys):
                return doc
        except (OSError, ValueError):
            pass  # none yet, or unreadable: computed again below
    doc = compute()
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(memo, {"source": str(source), **doc})
        except (OSError, OmnidraftError):
            pass  # a read-only home: computed again next time
    return doc


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file handle whose contents replace ``path`` only if the block completes.

    Temp sibling, flush + fsync, rename, fsync of the folder: a process killed at any moment
    leaves the old file or the new one. A path that is a directory, or whose folder is missing or
    read-only, is an OmnidraftError with one line that names the path; nothing is left behind.
    """
    target = Path(path).expanduser()
    if target.is_dir():
        raise OmnidraftError(f"cannot write {target}: it is a directory; give a file name")
    folder = target.resolve().parent
    if not folder.is_dir():
        raise OmnidraftError(f"cannot write {target}: folder {folder} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise OmnidraftError(f"cannot write {target}: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; these are ordinary user files
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        fsync_dir(folder)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OmnidraftError(f"cannot write {target}: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path) as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path).expanduser()


def atomic_write_json(path: str | os.PathLike, doc: Any, indent: int | None = 1) -> Path:
    return atomic_write(path, json.dumps(doc, ensure_ascii=False, indent=indent) + "\n")


def fsync_tree(folder: Path) -> None:
    """fsync every file under ``folder`` (before the folder is renamed into place)."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


class LockHeld(OmnidraftError):
    """Another live process holds the lock; the message names it."""


class FileLock:
    """An exclusive, non-blocking ``flock`` on ``path`` that records its owner's pid and command.

    ``acquire`` raises :class:`LockHeld` (one line: who holds it, what to do) instead of waiting.
    The lock belongs to the open file description, so a child started with the descriptor in
    ``pass_fds`` keeps it alive after the parent dies (the background trainer does that), and the
    kernel releases it when the last holder exits: a killed process never leaves a stale lock.
    """

    def __init__(self, path: str | os.PathLike, what: str) -> None:
        self.path = Path(path)
        self.what = what  # e.g. "the adapter folder ..." for the message
        self.fd: int | None = None

    def acquire(self) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            raise LockHeld(f"{self.what} is in use by {owner}; wait for it to finish") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {' '.join(sys.argv)[:200]}\n".encode("utf-8", "replace"))
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _read_owner(fd: int) -> str:
    try:
        text = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    pid, _, command = text.partition(" ")
    return f"process {pid} ({command})" if pid.isdigit() else "another process"
