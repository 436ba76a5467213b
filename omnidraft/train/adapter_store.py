"""Per-target LoRA adapters on disk: ``<home>/adapters/<drafter>--<target>/`` (see adapters/README.md).

Each published adapter is a peft folder (``adapter_config.json``, ``adapter_model.safetensors``)
plus ``omnidraft-adapter.json`` (identity of both tokenizers and of the drafter's architecture,
update counters, recent metrics), in a version folder ``v000012/``. The text file ``CURRENT``
names the live version, as LevelDB's CURRENT does: a version is written to a temporary folder,
fsynced, renamed into place, and only then does an atomic replace of ``CURRENT`` publish it. A
process killed at any moment leaves the old adapter or the new one; leftovers are swept later.

Loading checks everything before a tensor is used: the metadata parses and names this drafter
and target (vocabulary fingerprints, architecture fingerprint), the safetensors file reads, and
every LoRA tensor fits a linear layer of the drafter. A problem is one line, never silent use.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnidraft.home import home_dir

FORMAT_VERSION = 1
META_FILE = "omnidraft-adapter.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
CURRENT_FILE = "CURRENT"
KEEP_VERSIONS = 2
_VERSION_RE = re.compile(r"^v(\d{6})$")


class AdapterProblem(Exception):
    """An adapter that must not be used; the message is one line that says why."""


def spec_slug(spec: str) -> str:
    """A folder-safe name for a model spec: ``builtin:smollm2-135m`` -> ``smollm2-135m``;
    a path or hub id keeps its readable tail plus a short hash of the whole spec."""
    if spec.startswith("builtin:"):
        return spec[len("builtin:"):]
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.rstrip("/").split("/")[-1])[:40] or "model"
    return f"{tail}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}"


def adapters_root(home: str | os.PathLike | None = None) -> Path:
    """The adapters/ folder; not created here, so looking for an adapter leaves the home untouched."""
    return home_dir(home) / "adapters"


def pair_dir(drafter_spec: str, target_spec: str, home: str | os.PathLike | None = None) -> Path:
    return adapters_root(home) / f"{spec_slug(drafter_spec)}--{spec_slug(target_spec)}"


def architecture_fingerprint(model: torch.nn.Module) -> str:
    """Hash of the names and shapes of a model's linear weights: what a LoRA adapter attaches to."""
    h = hashlib.sha256()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            h.update(f"{name}:{tuple(weight.shape)}\n".encode())
    return h.hexdigest()[:16]


@dataclass
class Identity:
    """What an adapter belongs to; any difference makes it unusable."""

    drafter_vocab: str
    target_vocab: str
    drafter_arch: str

    def mismatch(self, other: dict) -> str | None:
        for key, mine in vars(self).items():
            if other.get(key) != mine:
                return f"{key.replace('_', ' ')} differs ({str(other.get(key))[:12]}… vs this {mine[:12]}…)"
        return None


def identity_of(drafter_tokenizer: Any, target_tokenizer: Any, drafter_model: torch.nn.Module) -> Identity:
    from omnidraft.ngram.store import vocab_fingerprint

    return Identity(vocab_fingerprint(drafter_tokenizer)[:16], vocab_fingerprint(target_tokenizer)[:16],
                    architecture_fingerprint(drafter_model))


@dataclass
class LoadedAdapter:
    path: Path
    state: dict[str, torch.Tensor]
    meta: dict
    scaling: float
    head_state: dict[str, torch.Tensor] | None = None  # the acceptance head's tensors, when trained

    @property
    def version(self) -> int:
        return int(self.meta.get("version", 0))


# ---- reading -----------------------------------------------------------------------------------
def current_version_dir(folder: Path) -> Path | None:
    """The live version folder of a pair folder (None when nothing was published yet).

    ``folder`` may also be a version folder itself (what ``--adapter PATH`` may point at)."""
    if (folder / META_FILE).is_file():
        return folder
    current = folder / CURRENT_FILE
    if not current.is_file():
        return None
    name = current.read_text().strip()
    if not _VERSION_RE.match(name):
        raise AdapterProblem(f"{current} is corrupt (names {name[:20]!r}, not a version folder)")
    path = folder / name
    if not path.is_dir():
        raise AdapterProblem(f"{current} names {name}, which is missing")
    return path


def read_meta(version_dir: Path) -> dict:
    try:
        meta = json.loads((version_dir / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterProblem(f"adapter {version_dir} has no readable {META_FILE} ({exc.__class__.__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or meta.get("kind") != "omnidraft-lora":
        raise AdapterProblem(f"adapter {version_dir} is not an omnidraft adapter of format {FORMAT_VERSION}")
    return meta


def load(folder: Path, identity: Identity | None) -> LoadedAdapter | None:
    """The live adapter under ``folder`` (pair or version folder), checked; None if none yet."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    version_dir = current_version_dir(folder)
    if version_dir is None:
        return None
    meta = read_meta(version_dir)
    if identity is not None:
        problem = identity.mismatch(meta.get("identity", {}))
        if problem:
            raise AdapterProblem(f"adapter {version_dir} was trained for another drafter/target pair: {problem}")
    try:
        state = load_file(str(version_dir / WEIGHTS_FILE))
        config = json.loads((version_dir / CONFIG_FILE).read_text())
        scaling = float(config["lora_alpha"]) / float(config["r"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, SafetensorError) as exc:
        raise AdapterProblem(f"adapter {version_dir} is corrupt ({exc.__class__.__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''})") from None
    if any(not torch.isfinite(t).all() for t in state.values()):
        raise AdapterProblem(f"adapter {version_dir} holds non-finite weights")
    return LoadedAdapter(version_dir, state, meta, scaling, _load_head(version_dir))


def _load_head(version_dir: Path) -> dict[str, torch.Tensor] | None:
    """The acceptance head saved beside the adapter (None for an adapter trained without one)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from omnidraft.train.accept_head import HEAD_FILE

    path = version_dir / HEAD_FILE
    if not path.is_file():
        return None
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise AdapterProblem(f"adapter {version_dir} has a corrupt acceptance head ({exc.__class__.__name__})") from None


def list_pairs(home: str | os.PathLike | None = None) -> list[Path]:
    root = adapters_root(home)
    return sorted(p for p in root.iterdir() if p.is_dir() and "--" in p.name) if root.is_dir() else []


# ---- writing -----------------------------------------------------------------------------------
def save(folder: Path, peft_model, meta: dict, head_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Publish a new version of the adapter (and its acceptance head) atomically; returns its folder."""
    from safetensors.torch import save_file

    from omnidraft.train.accept_head import HEAD_FILE

    folder.mkdir(parents=True, exist_ok=True)
    _sweep(folder)
    version = _next_version(folder)
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".tmp-"))
    try:
        peft_model.save_pretrained(str(tmp))
        if head_state is not None:
            save_file(head_state, str(tmp / HEAD_FILE))
        meta = dict(meta, format=FORMAT_VERSION, kind="omnidraft-lora", version=version, saved_at=time.time())
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        for path in tmp.iterdir():
            _fsync(path)
        final = folder / f"v{version:06d}"
        os.replace(tmp, final)
        _fsync_dir(folder)
        _write_atomic(folder / CURRENT_FILE, f"{final.name}\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune(folder, keep=final.name)
    return final


def remove(folder: Path) -> None:
    shutil.rmtree(folder)


def set_aside(version_dir: Path) -> Path:
    """Rename a bad version folder so it is never loaded again (kept for inspection)."""
    aside = version_dir.with_name(f"{version_dir.name}.bad-{int(time.time())}")
    os.replace(version_dir, aside)
    current = version_dir.parent / CURRENT_FILE
    if current.is_file() and current.read_text().strip() == version_dir.name:
        current.unlink()
    return aside


def _next_version(folder: Path) -> int:
    found = [int(m.group(1)) for p in folder.iterdir() if (m := _VERSION_RE.match(p.name.split(".")[0]))]
    return max(found, default=0) + 1


def _sweep(folder: Path) -> None:
    """Remove temporary folders a killed writer left behind."""
    for path in folder.glob(".tmp-*"):
        shutil.rmtree(path, ignore_errors=True)


def _prune(folder: Path, keep: str) -> None:
    versions = sorted(p for p in folder.iterdir() if _VERSION_RE.match(p.name))
    for path in versions[:-KEEP_VERSIONS]:
        if path.name != keep:
            shutil.rmtree(path, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
