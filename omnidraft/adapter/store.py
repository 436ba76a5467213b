"""Per-target LoRA adapters on disk, as decoding reads them: ``<home>/adapters/<drafter>--<target>/``.

Layout (see ``adapters/README.md``): each published adapter is a peft folder
(``adapter_config.json``, ``adapter_model.safetensors``) plus ``omnidraft-adapter.json``
(identity of both tokenizers and of the drafter's architecture, update counters, recent metrics),
in a version folder ``v000012/``; the text file ``CURRENT`` names the live version, as LevelDB's
does. Publishing a version is the trainer's job (``omnidraft.train.publish``); this module only
reads, checks, and removes what omnidraft itself made.

Loading checks everything before a tensor is used: the metadata parses, has the right field
types and names this drafter and target (vocabulary and architecture fingerprints), the
safetensors file reads and holds finite numbers. A problem is one line, never silent use.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnidraft.errors import OmnidraftError
from omnidraft.fsutil import FileLock
from omnidraft.home import home_dir
from omnidraft.identity import pair_slug, vocab_fingerprint

BASE_WEIGHTS = "none"  # the weights key of a drafter that runs no adapter (``AdapterSlot.weights``)

FORMAT_VERSION = 1
KIND = "omnidraft-lora"
META_FILE = "omnidraft-adapter.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
HEAD_FILE = "accept_head.safetensors"
CURRENT_FILE = "CURRENT"
LOCK_FILE = ".lock"
LOG_FILE = "trainer.log"
VERSION_RE = re.compile(r"^v(\d{6})$")
# Everything omnidraft may leave in a pair folder; a folder holding anything else is not removed.
_OWNED_RE = re.compile(r"^(CURRENT|\.lock|trainer\.log|v\d{6}(\.bad-\d+)?|\.tmp-.*|\.CURRENT\..*\.tmp)$")

# Fields of the metadata that list/show/load use, with the types they must have.
_META_TYPES: dict[str, type | tuple[type, ...]] = {
    "version": int, "updates": int, "records_seen": int, "tokens_seen": int, "saved_at": (int, float),
    "drafter": str, "target": str, "identity": dict, "history": list, "train_config": dict,
}


class AdapterProblem(Exception):
    """An adapter that must not be used; the message is one line that says why."""


def adapters_root(home: str | os.PathLike | None = None) -> Path:
    """The adapters/ folder; not created here, so looking for an adapter leaves the home untouched."""
    return home_dir(home) / "adapters"


def pair_dir(drafter_spec: str, target_spec: str, home: str | os.PathLike | None = None) -> Path:
    return adapters_root(home) / pair_slug(drafter_spec, target_spec)


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

    def mismatch(self, other: Any) -> str | None:
        if not isinstance(other, dict):
            return "its identity record is missing"
        for key, mine in vars(self).items():
            if other.get(key) != mine:
                return f"{key.replace('_', ' ')} differs ({str(other.get(key))[:12]}… vs this {mine[:12]}…)"
        return None


def identity_of(drafter_tokenizer: Any, target_tokenizer: Any, drafter_model: torch.nn.Module) -> Identity:
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
    try:
        name = current.read_bytes()[:64].decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        name = None
    if name is None or not VERSION_RE.match(name):
        raise AdapterProblem(f"{current} is corrupt (it does not name a version folder)")
    path = folder / name
    if not path.is_dir():
        raise AdapterProblem(f"{current} names {name}, which is missing")
    return path


def read_meta(version_dir: Path) -> dict:
    """The metadata of a version folder, with every field list/show/load use type-checked."""
    try:
        meta = json.loads((version_dir / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterProblem(f"adapter {version_dir} has no readable {META_FILE} ({exc.__class__.__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or meta.get("kind") != KIND:
        raise AdapterProblem(f"adapter {version_dir} is not an omnidraft adapter of format {FORMAT_VERSION}")
    for key, kind in _META_TYPES.items():
        value = meta.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise AdapterProblem(f"adapter {version_dir}: metadata field {key!r} has the wrong type")
    if not all(isinstance(h, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in h.values())
               for h in meta.get("history") or []):
        raise AdapterProblem(f"adapter {version_dir}: metadata field 'history' is malformed")
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
        problem = identity.mismatch(meta.get("identity"))
        if problem:
            raise AdapterProblem(f"adapter {version_dir} was trained for another drafter/target pair: {problem}")
    try:
        state = load_file(str(version_dir / WEIGHTS_FILE))
        config = json.loads((version_dir / CONFIG_FILE).read_text(encoding="utf-8"))
        scaling = float(config["lora_alpha"]) / float(config["r"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, SafetensorError) as exc:
        detail = str(exc).splitlines()[0][:80] if str(exc) else ""
        raise AdapterProblem(f"adapter {version_dir} is corrupt ({exc.__class__.__name__}: {detail})") from None
    if not state or not all(t.is_floating_point() and torch.isfinite(t).all() for t in state.values()):
        raise AdapterProblem(f"adapter {version_dir} holds no usable weights (empty or non-finite)")
    if not (scaling > 0 and scaling < float("inf")):
        raise AdapterProblem(f"adapter {version_dir} has an unusable LoRA scaling in {CONFIG_FILE}")
    return LoadedAdapter(version_dir, state, meta, scaling, _load_head(version_dir))


def _load_head(version_dir: Path) -> dict[str, torch.Tensor] | None:
    """The acceptance head saved beside the adapter (None for an adapter trained without one)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

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


# ---- the writer's lock, and removal ------------------------------------------------------------
def writer_lock(folder: Path) -> FileLock:
    """The lock every writer of a pair folder holds: the trainer while it may publish, `remove`."""
    return FileLock(folder / LOCK_FILE, f"the adapter folder {folder}")


def owned_pair_folder(name: str, home: str | os.PathLike | None = None) -> Path:
    """The pair folder ``name`` designates, if it is one omnidraft made under ``<home>/adapters``.

    ``name`` is a pair folder name as `adapters list` prints it, or a path that resolves to one
    inside ``<home>/adapters``. Anything else — the working directory, a user's folder that
    happens to share the name, a symlink out of the home, a folder with files omnidraft did not
    write — is refused, so a destructive command can only ever touch omnidraft's own state.
    """
    root = adapters_root(home).resolve()
    given = Path(name).expanduser()
    candidate = given if (given.is_absolute() or os.sep in name or name in (".", "..")) else root / name
    if candidate.is_symlink():
        raise OmnidraftError(f"{name!r} is a symbolic link, not an adapter folder under {root}; nothing removed")
    resolved = candidate.resolve()
    if resolved.parent != root or "--" not in resolved.name:
        raise OmnidraftError(f"{name!r} is not an adapter pair folder under {root} "
                             "(`omnidraft adapters list` shows them); nothing removed")
    if not resolved.is_dir():
        raise OmnidraftError(f"no adapter named {name!r} under {root}; `omnidraft adapters list` shows them")
    foreign = [p.name for p in resolved.iterdir() if not _OWNED_RE.match(p.name)]
    if foreign:
        raise OmnidraftError(f"{resolved} holds files omnidraft did not write ({', '.join(sorted(foreign)[:3])}); "
                             "nothing removed")
    return resolved


def remove(folder: Path) -> None:
    """Delete a pair folder checked by :func:`owned_pair_folder`, unless a trainer is writing it."""
    with writer_lock(folder):
        for path in folder.iterdir():
            if path.name == LOCK_FILE:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    shutil.rmtree(folder)



def writable_pair_folder(path: Path) -> Path:
    """A folder a trainer may publish into (``adapt --save-to``): new, empty, or omnidraft's own.

    Publishing prunes old version folders and sweeps temporary ones, so it must never be pointed
    at a folder holding anything else.
    """
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OmnidraftError(f"{folder} is a file, not a folder for an adapter")
    if folder.is_dir():
        foreign = [p.name for p in folder.iterdir() if not _OWNED_RE.match(p.name)]
        if foreign:
            raise OmnidraftError(f"{folder} holds files omnidraft did not write ({', '.join(sorted(foreign)[:3])}); "
                                 "give a new or empty folder")
    return folder
