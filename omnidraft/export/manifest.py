"""An export folder's ``manifest.json``, checked field by field and against the graph it describes.

The manifest is what a reader trusts before it touches the graph: the number of layers sets how
many cache inputs are fed, ``kv_heads`` and ``head_dim`` the shape of the empty cache, ``lora`` the
shapes of an adapter's tensors, ``adapters`` which files to activate. A hand-edited or damaged
manifest must therefore be refused in one line before any of it is used, never become an
onnxruntime error, a ``KeyError`` or a list of 480 input names. :func:`read_manifest` checks the
fields (types, ranges, the input/output lists it implies, adapter file names that stay inside the
folder); :func:`check_graph` checks them against the inputs and outputs the graph really has.

This module imports neither torch nor onnx: the onnxruntime backend and the export share it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omnidraft.errors import OmnidraftError

FORMAT = 2  # 2: logits [1, 1, vocab], the rank onnxruntime-genai reads, and a genai_config.json
READABLE_FORMATS = (1, 2)  # 1: logits [1, vocab]; such folders still run here (not on onnxruntime-genai)
KIND = "omnidraft-onnx-drafter"
MANIFEST = "manifest.json"
MODEL = "model.onnx"
GENAI_CONFIG = "genai_config.json"  # the folder as onnxruntime-genai loads it (format 2 on)
QUANTS = ("fp32", "int8")
ADAPTERS_DIR = "adapters"
ADAPTER_SUFFIX = ".onnx_adapter"
HEAD_SUFFIX = ".head.npz"
# A name a user gives (`export --adapter NAME`) or a manifest holds: one plain path component.
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_POSITIVE = ("layers", "kv_heads", "head_dim", "hidden_size", "vocab_size", "max_positions")

Shape = Sequence[int | str | None]


def _refuse(folder: Path, detail: str) -> OmnidraftError:
    return OmnidraftError(f"the export manifest {Path(folder) / MANIFEST} {detail}; export again")


# ---------------------------------------------------------------- names from users


def check_name(name: str, what: str = "adapter name") -> str:
    """``name`` if it is one plain file-name component (no separator, no ``..``, not hidden, not
    absolute), else a one-line error: every path omnidraft builds from it stays in its folder."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
        raise OmnidraftError(f"{what} {str(name)[:80]!r} is not a plain name (letters, digits, '.', '-', '_'; "
                             "no path, no '..')")
    return name


def adapter_file_ok(rel: Any, suffix: str) -> bool:
    """Whether a manifest's adapter path is ``adapters/<plain name><suffix>`` (nothing that leaves
    the export folder, no hidden or temporary file)."""
    if not isinstance(rel, str) or "\\" in rel:
        return False
    parts = rel.split("/")
    return (len(parts) == 2 and parts[0] == ADAPTERS_DIR and parts[1].endswith(suffix)
            and bool(_NAME_RE.match(parts[1])) and ".." not in parts[1])


# ---------------------------------------------------------------- the fields


def read_manifest(folder: Path) -> dict:
    """The manifest of an export folder, every field checked; one line for a missing, damaged,
    foreign or inconsistent one (see :func:`check_fields`)."""
    import json

    folder = Path(folder)
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OmnidraftError(f"{folder} is not an omnidraft export (no {MANIFEST}); run `omnidraft export`") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise OmnidraftError(f"the export manifest {path} is unreadable ({exc.__class__.__name__}); export again") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND or manifest.get("format") not in READABLE_FORMATS:
        raise OmnidraftError(f"{folder} is not an omnidraft export of format {FORMAT}; export again")
    model = folder / MODEL
    if not model.is_file() or not Path(f"{model}.data").is_file():
        raise OmnidraftError(f"the export {folder} is incomplete ({MODEL} or its weights are missing); export again")
    check_fields(manifest, folder)
    return manifest


def check_fields(m: dict, folder: Path) -> None:
    """Types and ranges of every field a reader uses, and the input/output names they imply."""
    for key in _POSITIVE:
        value = m.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 1 << 24:
            found = f"found {str(value)[:40]!r}" if key in m else "missing"
            raise _refuse(folder, f"has no usable {key!r} (a positive whole number; {found})")
    if m.get("quant") not in QUANTS:
        raise _refuse(folder, f"names an unknown quant {str(m.get('quant'))[:20]!r}")
    for key in ("architecture", "drafter"):
        if not isinstance(m.get(key), str):
            raise _refuse(folder, f"has no usable {key!r}")
    _check_lora(m.get("lora"), folder)
    for key, expected in (("inputs", expected_inputs(m)), ("outputs", expected_outputs(m))):
        given = m.get(key)
        if given != expected:
            raise _refuse(folder, f"lists {key} that do not follow from its layers and lora fields "
                                  f"({_first_difference(given, expected)})")
    _check_adapters(m.get("adapters"), folder)
    targets = m.get("targets")
    if not isinstance(targets, dict) or not all(isinstance(k, str) and _NAME_RE.match(k) and isinstance(v, dict)
                                                for k, v in targets.items()):
        raise _refuse(folder, "has a malformed 'targets' field")


def _check_lora(lora: Any, folder: Path) -> None:
    if not isinstance(lora, dict):
        raise _refuse(folder, "has no 'lora' field (module -> in/out features)")
    for module, shape in lora.items():
        ok = isinstance(shape, dict) and all(isinstance(shape.get(k), int) and not isinstance(shape.get(k), bool)
                                             and shape.get(k) > 0 for k in ("in", "out"))
        if not isinstance(module, str) or not ok:
            raise _refuse(folder, f"has a malformed 'lora' entry {str(module)[:60]!r}")


def _check_adapters(adapters: Any, folder: Path) -> None:
    """Each entry names files under ``adapters/`` that exist and are not links out of the folder."""
    if not isinstance(adapters, dict):
        raise _refuse(folder, "has no 'adapters' field (an object, empty when none was exported)")
    for name, entry in adapters.items():
        if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name or not isinstance(entry, dict):
            raise _refuse(folder, f"has a malformed 'adapters' entry {str(name)[:60]!r}")
        version = entry.get("version")
        if (not isinstance(version, int) or isinstance(version, bool) or version < 0
                or not isinstance(entry.get("sha256"), str) or not _SHA_RE.match(entry["sha256"])):
            raise _refuse(folder, f"has a malformed 'adapters' entry {name!r} (version, sha256)")
        for rel in adapter_files(entry):
            if not adapter_file_ok(rel, HEAD_SUFFIX if rel.endswith(HEAD_SUFFIX) else ADAPTER_SUFFIX):
                raise _refuse(folder, f"gives adapter {name!r} a file outside {ADAPTERS_DIR}/ ({str(rel)[:60]!r})")
            path = Path(folder) / rel
            if path.is_symlink() or not path.is_file():
                raise _refuse(folder, f"names adapter file {rel} which is missing")


def adapter_files(entry: dict) -> list[str]:
    """The files one manifest adapter entry refers to (its ``.onnx_adapter`` and head, if any).

    Entries written before heads had a file field say ``"head": true`` and keep the head at
    ``adapters/<name>.head.npz`` beside ``adapters/<name>.onnx_adapter``."""
    rel = entry.get("file")
    files = [rel]
    head = entry.get("head_file")
    if head is not None:
        files.append(head)
    elif entry.get("head") is True and isinstance(rel, str) and rel.endswith(ADAPTER_SUFFIX):
        files.append(rel[: -len(ADAPTER_SUFFIX)] + HEAD_SUFFIX)
    elif entry.get("head") not in (None, False, True):
        files.append(None)  # refused by the caller's path check
    return files


def expected_inputs(m: Mapping[str, Any]) -> list[str]:
    """Graph inputs, in order, that the layers and lora fields imply (``graph.FlatDrafter``)."""
    kv = [f"past_key_values.{i}.{w}" for i in range(m["layers"]) for w in ("key", "value")]
    lora = [f"{module}.lora_{ab}.weight" for module in m["lora"] for ab in ("A", "B")]
    return ["input_ids", *kv, *lora]


def expected_outputs(m: Mapping[str, Any]) -> list[str]:
    return ["logits", "hidden", *[f"present.{i}.{w}" for i in range(m["layers"]) for w in ("key", "value")]]


def _first_difference(given: Any, expected: list[str]) -> str:
    if not isinstance(given, list):
        return f"not a list: {type(given).__name__}"
    if len(given) != len(expected):
        return f"{len(given)} names where {len(expected)} are implied"
    for n, (a, b) in enumerate(zip(given, expected)):
        if a != b:
            return f"#{n} is {str(a)[:60]!r}, expected {b!r}"
    return "same names"


# ---------------------------------------------------------------- against the graph


def expected_shapes(m: Mapping[str, Any]) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """name -> shape of every graph input and output (an int: that size; None: a dynamic axis)."""
    kv = (1, m["kv_heads"], None, m["head_dim"])
    inputs: dict[str, tuple] = {"input_ids": (1, None)}
    inputs.update({name: kv for name in expected_inputs(m)[1: 1 + 2 * m["layers"]]})
    for module, shape in m["lora"].items():
        inputs[f"{module}.lora_A.weight"] = (shape["in"], None)
        inputs[f"{module}.lora_B.weight"] = (None, shape["out"])
    logits = (1, m["vocab_size"]) if m.get("format") == 1 else (1, 1, m["vocab_size"])
    outputs: dict[str, tuple] = {"logits": logits, "hidden": (1, m["hidden_size"])}
    outputs.update({name: kv for name in expected_outputs(m)[2:]})
    return inputs, outputs


def last_row(logits):
    """The last position's [vocab] logits from a graph's ``logits`` output ([1, 1, vocab]; [1, vocab]
    in format 1 folders)."""
    return logits.reshape(-1, logits.shape[-1])[-1]


def check_graph(m: Mapping[str, Any], folder: Path, inputs: Mapping[str, Shape], outputs: Mapping[str, Shape]) -> None:
    """The graph's inputs and outputs (name -> shape, ints fixed, str/None dynamic) are exactly the
    manifest's, with its layers, kv_heads, head_dim, hidden and vocab sizes and LoRA shapes."""
    want_in, want_out = expected_shapes(m)
    for kind, want, have in (("input", want_in, inputs), ("output", want_out, outputs)):
        missing = [n for n in want if n not in have]
        extra = [n for n in have if n not in want]
        if missing or extra:
            what = f"lacks {kind} {missing[0]!r}" if missing else f"has an {kind} {extra[0]!r} the manifest does not list"
            raise _refuse(folder, f"does not match its graph: the graph {what} ({len(missing)} missing, {len(extra)} unlisted)")
        for name, shape in want.items():
            if not _shape_fits(have[name], shape):
                raise _refuse(folder, f"does not match its graph: {kind} {name!r} has shape {_show(have[name])}, "
                                      f"the manifest implies {_show(shape)}")


def _shape_fits(have: Shape | None, want: tuple) -> bool:
    if have is None or len(have) != len(want):
        return False
    return all((w is None and not isinstance(h, int)) or (w is not None and h == w) for h, w in zip(have, want))


def _show(shape: Shape | None) -> str:
    return "unknown" if shape is None else "[" + ", ".join("?" if not isinstance(d, int) else str(d) for d in shape) + "]"


def onnx_signature(model_path: Path) -> tuple[dict[str, list], dict[str, list]]:
    """Inputs and outputs (name -> shape) of an ONNX file, read without its external weights."""
    import onnx

    try:
        graph = onnx.load(str(model_path), load_external_data=False).graph
    except Exception as exc:  # onnx raises DecodeError and friends for a damaged file
        raise OmnidraftError(f"the export graph {model_path} is unreadable ({exc.__class__.__name__}); export again") from None

    def shape(value) -> list:
        return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in value.type.tensor_type.shape.dim]

    return {v.name: shape(v) for v in graph.input}, {v.name: shape(v) for v in graph.output}


def session_signature(session: Any) -> tuple[dict[str, list], dict[str, list]]:
    """Inputs (required, and the LoRA inputs whose defaults are initializers) and outputs of an
    onnxruntime session, name -> shape."""
    inputs = {a.name: list(a.shape) if a.shape is not None else None
              for a in [*session.get_inputs(), *session.get_overridable_initializers()]}
    return inputs, {a.name: list(a.shape) if a.shape is not None else None for a in session.get_outputs()}
