"""Publishing a new adapter version atomically (the trainer's side of ``omnidraft.adapter.store``).

A version is written to a temporary folder inside the pair folder, every file fsynced, renamed
into place, and only then does an atomic replace of ``CURRENT`` publish it. A process killed at
any moment leaves the old adapter or the new one; temporary leftovers are swept by the next save.
Only the trainer that holds the pair folder's writer lock calls this.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from omnidraft.adapter.store import (
    CURRENT_FILE,
    FORMAT_VERSION,
    HEAD_FILE,
    KIND,
    META_FILE,
    VERSION_RE,
)
from omnidraft.fsutil import atomic_write, atomic_write_json, fsync_dir, fsync_tree

KEEP_VERSIONS = 2


def save(folder: Path, peft_model, meta: dict, head_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Publish a new version of the adapter (and its acceptance head); returns its folder."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    _sweep(folder)
    version = _next_version(folder)
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".tmp-"))
    try:
        peft_model.save_pretrained(str(tmp))
        if head_state is not None:
            save_file(head_state, str(tmp / HEAD_FILE))
        meta = dict(meta, format=FORMAT_VERSION, kind=KIND, version=version, saved_at=time.time())
        atomic_write_json(tmp / META_FILE, meta)
        fsync_tree(tmp)
        final = folder / f"v{version:06d}"
        tmp.rename(final)
        fsync_dir(folder)
        atomic_write(folder / CURRENT_FILE, f"{final.name}\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune(folder, keep=final.name)
    return final


def _next_version(folder: Path) -> int:
    found = [int(m.group(1)) for p in folder.iterdir() if (m := VERSION_RE.match(p.name.split(".")[0]))]
    return max(found, default=0) + 1


def _sweep(folder: Path) -> None:
    """Remove temporary folders a killed writer left behind."""
    for path in folder.glob(".tmp-*"):
        shutil.rmtree(path, ignore_errors=True)


def _prune(folder: Path, keep: str) -> None:
    versions = sorted(p for p in folder.iterdir() if VERSION_RE.match(p.name))
    for path in versions[:-KEEP_VERSIONS]:
        if path.name != keep:
            shutil.rmtree(path, ignore_errors=True)
