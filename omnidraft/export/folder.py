"""An export folder on disk: replaced atomically under a lock, repaired after a kill, readable by apps.

Replacing an export (hundreds of MB) cannot be one rename over a non-empty folder, so it is three
steps, each atomic, under the export's writer lock (the same ``FileLock`` the adapters' writers
hold, on ``.<name>.lock`` beside the folder):

1. the new export is written in full to a temporary sibling ``.<name>.tmp-<pid>-<random>``;
2. the old folder is renamed aside to ``.<name>.old-<pid>-<n>``, and the new one renamed in;
3. the old one is removed.

A process killed at any moment leaves the old export or the new one in place, or neither in place
but a complete one beside it (between the two renames of step 2). :func:`recover`, run by every
``export`` command before it writes and by the onnxruntime backend before it loads, finishes that:
it moves the newest complete export left beside a missing folder into place (a finished new one
first, else the old one set aside), and removes what dead processes left (temporary and set-aside
folders; their pid is in the name). The lock makes sure it never touches a live writer's folder.

Every file and folder of an export gets one permission policy, :func:`set_modes`: what a plain
``open``/``mkdir`` gives under the user's umask (0644 / 0755 with the usual 022), because an
export is meant to be read by an app or another account on the machine. Temporary-file helpers
create private (0600) files, so each writer applies the policy before it publishes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omnidraft.console import notice
from omnidraft.errors import OmnidraftError
from omnidraft.export.manifest import KIND, MANIFEST, MODEL
from omnidraft.fsutil import FileLock, LockHeld, fsync_dir

# What an export folder may hold: a folder with only these names and no manifest is what a killed
# `rmtree` of an export left (older omnidraft versions removed the old folder in place).
_EXPORT_ENTRY = re.compile(r"^(manifest\.json|model\.onnx(\.data)?|bridge|adapters|tokenizer[\w.-]*|special_tokens_map\.json|"
                           r"vocab\.json|merges\.txt|added_tokens\.json|chat_template\.jinja|\..*\.tmp)$")
_held: dict[str, tuple[FileLock, int]] = {}


# ---------------------------------------------------------------- names beside the folder


def _tmp_re(out: Path) -> re.Pattern[str]:
    return re.compile(rf"^\.{re.escape(out.name)}\.(tmp|old)-(\d+)-[\w]+$")


def _legacy_re(out: Path) -> re.Pattern[str]:
    """Temporary folders of omnidraft versions before the lock (``tempfile.mkdtemp(prefix=".<name>-")``)."""
    return re.compile(rf"^\.{re.escape(out.name)}-[a-z0-9_]{{8}}$")


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def new_temp(out: Path) -> Path:
    """A fresh, private temporary sibling of ``out`` that names its owner (this process)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-{os.getpid()}-"))


def _aside_name(out: Path) -> Path:
    n = 0
    while (candidate := out.parent / f".{out.name}.old-{os.getpid()}-{n}").exists():
        n += 1
    return candidate


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def leftovers(out: Path) -> list[tuple[Path, str, int | None]]:
    """(path, kind, owner pid) of every temporary or set-aside sibling of ``out``; kind is 'tmp',
    'old' or 'legacy' (an older version's temporary folder, owner unknown)."""
    if not out.parent.is_dir():
        return []
    ours, legacy = _tmp_re(out), _legacy_re(out)
    found = []
    for path in out.parent.iterdir():
        if (m := ours.match(path.name)) is not None:
            found.append((path, m.group(1), int(m.group(2))))
        elif legacy.match(path.name) and path.is_dir() and not path.is_symlink():
            found.append((path, "legacy", None))
    return found


# ---------------------------------------------------------------- the lock


@contextmanager
def holding(out: Path) -> Iterator[None]:
    """The export's writer lock for the block; re-entrant within this process (the CLI holds it for
    the whole command, the writers it calls take it again), refused in one line when another
    process holds it. The kernel drops it when its holder dies: no stale lock after a kill."""
    out.parent.mkdir(parents=True, exist_ok=True)
    key = str(lock_path(out).resolve())
    if key in _held:
        lock, depth = _held[key]
        _held[key] = (lock, depth + 1)
    else:
        lock = FileLock(lock_path(out), f"the export {out}").acquire()
        _held[key] = (lock, 1)
    try:
        yield
    finally:
        lock, depth = _held[key]
        if depth == 1:
            del _held[key]
            lock.release()
        else:
            _held[key] = (lock, depth - 1)


# ---------------------------------------------------------------- what a folder is


def is_export(folder: Path) -> bool:
    """A complete export omnidraft wrote: its manifest names our kind and the graph files exist."""
    try:
        kind = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):
        return False
    return kind == KIND and (folder / MODEL).is_file() and (folder / f"{MODEL}.data").is_file()


def _is_remnant(folder: Path) -> bool:
    """A folder without a manifest holding only names an export holds: a killed removal's leftover."""
    if folder.is_symlink() or not folder.is_dir() or (folder / MANIFEST).exists():
        return False
    try:
        return all(_EXPORT_ENTRY.match(p.name) for p in folder.iterdir())
    except OSError:
        return False


def check_replaceable(out: Path) -> None:
    """Refuse (one line) to replace anything but nothing, an export, or an export's remnant."""
    if out.is_symlink() and not out.exists():
        raise OmnidraftError(f"{out} is a broken symbolic link; remove it or give --out")
    if out.exists() and not out.is_dir():
        raise OmnidraftError(f"{out} is a file, not an export folder; move it away or give --out")
    if out.is_dir() and not (is_export(out) or _is_remnant(out) or not any(out.iterdir())):
        raise OmnidraftError(f"{out} exists and is not an export omnidraft wrote; move it away or give --out")


def _created(folder: Path) -> float:
    try:
        created = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("created")
    except (OSError, ValueError, AttributeError):
        return 0.0
    return float(created) if isinstance(created, (int, float)) and not isinstance(created, bool) else 0.0


# ---------------------------------------------------------------- replace and repair


def commit(tmp: Path, out: Path) -> None:
    """Move the complete export ``tmp`` to ``out``, replacing what is there (see the module doc).
    The caller holds :func:`holding` and has checked :func:`check_replaceable`."""
    aside = None
    if out.exists() or out.is_symlink():
        aside = _aside_name(out)
        os.rename(out, aside)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    if aside is not None:
        _remove(aside)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def recover(out: Path) -> list[str]:
    """Finish or undo what interrupted writers of ``out`` left (caller holds :func:`holding`).

    When ``out`` is missing or only a remnant, the newest complete export beside it moves into
    place: a finished new one (the kill came between the two renames) before the old one set
    aside. Then the folders of dead owners are removed. Returns what was done, one phrase each.
    """
    done: list[str] = []
    stale = [(p, kind) for p, kind, pid in leftovers(out) if pid is None or not _alive(pid)]
    missing = not out.exists() and not out.is_symlink()
    if missing or _is_remnant(out):
        complete = [(p, kind) for p, kind in stale if is_export(p)]
        if complete:
            chosen, kind = max(complete, key=lambda item: (item[1] != "old", _created(item[0])))
            if not missing:
                remnant = _aside_name(out)
                os.rename(out, remnant)
                stale.append((remnant, "old"))
            set_modes(chosen)  # a writer killed before it applied the policy left a private folder
            os.rename(chosen, out)
            fsync_dir(out.parent)
            stale.remove((chosen, kind))
            done.append(f"{'restored the previous' if kind == 'old' else 'finished the interrupted'} export {out}")
    for path, _ in stale:
        if path.exists() or path.is_symlink():
            _remove(path)
            done.append(f"removed {path.name}")
    if done:
        fsync_dir(out.parent)
    return done


def needs_recovery(out: Path) -> bool:
    """Whether :func:`recover` has anything to do (cheap: no lock, no write)."""
    try:
        return bool(leftovers(out)) or _is_remnant(out)
    except OSError:  # a folder we may not list: nothing we could repair either
        return False


def settle(out: Path, quiet: bool = False) -> None:
    """Best-effort :func:`recover` for a reader (the onnxruntime backend, the runtime's export
    lookup): only when something was left, never waiting for a live writer, never failing on a
    read-only location. A reader must not lose the drafter because a writer was killed."""
    if not needs_recovery(out):
        return
    try:
        with holding(out):
            done = recover(out)
    except (LockHeld, OSError):
        return  # an export is running (its folders are live), or we may not write here
    if done and not quiet:
        notice(f"repaired what an interrupted `omnidraft export` left: {'; '.join(done)}")


# ---------------------------------------------------------------- one permission policy


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def set_modes(*paths: Path) -> None:
    """The export's permission policy on these paths (folders recursively): what a plain
    open/mkdir gives under the umask, so an app or another user can read the export."""
    mask = _umask()
    for root in paths:
        for path in [root, *(root.rglob("*") if root.is_dir() and not root.is_symlink() else [])]:
            if not path.is_symlink():
                path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
