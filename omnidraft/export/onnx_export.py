"""``omnidraft export``: the drafter as an ONNX graph an app runs with onnxruntime alone.

One folder per (drafter, quant) under ``<home>/export/``:

    model.onnx              the decoder (``graph.FlatDrafter``): KV-cache inputs/outputs, last-position
                            logits and hidden state, LoRA weights as inputs with empty defaults
    model.onnx.data         its weights (external data, so the graph stays small to parse)
    tokenizer.json …        the drafter's tokenizer files
    bridge/<target>/        the vocabulary bridge per target: d2t.npy (drafter id -> target id, -1: none),
                            t2d.npy, token_bytes.npy + token_offsets.npy (each drafter token's bytes)
    adapters/<pair>.onnx_adapter   trained adapters (onnxruntime.AdapterFormat, α/r folded into B)
    adapters/<pair>.head.npz       their acceptance heads
    manifest.json           drafter identity and sha256, opset, quant, inputs/outputs, adapters, targets, versions

The exporter is the TorchScript-based ``torch.onnx.export`` around the flat module: it gives full
control over names and dynamic axes (prefill and one-token steps share one graph; the LoRA rank is
dynamic), and optimum does not support transformers 5, while onnxruntime-genai's builder bakes
LoRA in as fixed weights. int8 is 8-bit block-wise weights for the base MatMuls only (the LoRA
MatMuls, which see tiny and changing weights, stay float).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from omnidraft.errors import OmnidraftError
from omnidraft.fsutil import atomic_write_json, fsync_tree

FORMAT = 1
OPSET = 17
QUANTS = ("fp32", "int8")
MANIFEST = "manifest.json"
MODEL = "model.onnx"


def export_dir(home_root: Path, drafter_slug: str, quant: str) -> Path:
    return home_root / "export" / f"{drafter_slug}-{quant}"


def export_drafter(model: Any, tokenizer: Any, out: Path, *, quant: str = "fp32", spec: str = "",
                   model_sha256: str = "", bridges: dict[str, Any] | None = None, progress: bool = True) -> Path:
    """Write the export folder ``out`` atomically (a temporary sibling renamed into place)."""
    import onnx
    import torch

    from omnidraft.export.graph import FlatDrafter

    if quant not in QUANTS:
        raise OmnidraftError(f"unknown --quant {quant!r}; choose one of {', '.join(QUANTS)}")
    flat = FlatDrafter(model).eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        raw = tmp / "raw.onnx"
        names_in, names_out = flat.input_names(), flat.output_names()
        dynamic = {"input_ids": {1: "seq"}}
        for name in names_in[1: 1 + 2 * flat.layers]:
            dynamic[name] = {2: "past"}
        for name in names_out[2:]:
            dynamic[name] = {2: "total"}
        for name in names_in[1 + 2 * flat.layers:]:
            dynamic[name] = {1 if name.endswith("lora_A.weight") else 0: "rank"}
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer notes: chosen on purpose
            torch.onnx.export(flat, flat.example(), str(raw), input_names=names_in, output_names=names_out,
                              dynamic_axes=dynamic, opset_version=OPSET, dynamo=False, do_constant_folding=True)
        graph = onnx.load(str(raw))
        _empty_lora_defaults(graph, flat)
        final = tmp / MODEL
        onnx.save(graph, str(final), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=f"{MODEL}.data", size_threshold=1024)
        raw.unlink()
        if quant == "int8":
            _quantize_int8(final, tmp)
        tokenizer.save_pretrained(tmp)
        targets = {name: _write_bridge(tmp / "bridge" / name, bridge) for name, bridge in (bridges or {}).items()}
        manifest = {
            "format": FORMAT, "kind": "omnidraft-onnx-drafter", "drafter": spec, "drafter_sha256": model_sha256,
            "architecture": _arch_fingerprint(model), "quant": quant, "opset": OPSET,
            "layers": flat.layers, "kv_heads": flat.kv_heads, "head_dim": flat.head_dim,
            "hidden_size": int(model.config.hidden_size), "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
            "max_positions": int(model.config.max_position_embeddings),
            "inputs": names_in, "outputs": names_out,
            "lora": {m: {"in": i, "out": o} for m, (i, o) in flat.lora_shapes().items()},
            "adapters": {}, "targets": targets, "created": time.time(), "versions": _versions(),
        }
        atomic_write_json(tmp / MANIFEST, manifest)
        _readable(tmp)
        fsync_tree(tmp)
        if out.exists():
            _remove_export(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _readable(folder: Path) -> None:
    """The modes a plain mkdir/open would give (mkdtemp and atomic writes make private files):
    an app or another user of the machine reads the export."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _empty_lora_defaults(graph, flat) -> None:
    """Rank-0 initializers for every LoRA input: running with no adapter is exactly the base model."""
    from onnx import numpy_helper

    shapes = flat.lora_shapes()
    for module, (inp, out) in shapes.items():
        for name, shape in ((f"{module}.lora_A.weight", (inp, 0)), (f"{module}.lora_B.weight", (0, out))):
            graph.graph.initializer.append(numpy_helper.from_array(np.zeros(shape, dtype=np.float32), name))


def _quantize_int8(model_path: Path, folder: Path) -> None:
    """8-bit weights for the base MatMuls (onnxruntime's MatMulNBits, blocks of 32, int8 compute).

    Measured against dynamic int8 (per-tensor and per-channel) and 4-bit blocks on this CPU
    (docs/onnx.md): the fastest at the best agreement with the float drafter. The LoRA MatMuls are
    excluded by name and stay in float, so the quantized graph still takes adapters as inputs.
    """
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    graph = onnx.load(str(model_path))
    lora_inputs = [value for value in graph.graph.input if ".lora_" in value.name]
    # The LoRA MatMuls read graph inputs whose defaults are (rank-0) initializers: left to itself the
    # quantizer takes those for constant weights and bakes the empty adapter in, and the inputs vanish.
    lora_nodes = [node.name for node in graph.graph.node if any(".lora_" in name for name in node.input)]
    config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4, bits=8)
    quantizer = MatMulNBitsQuantizer(graph, nodes_to_exclude=lora_nodes, algo_config=config)
    quiet = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level, quiet.level = quiet.level, logging.WARNING  # it logs every node it visits at INFO
    try:
        quantizer.process()
    finally:
        quiet.setLevel(level)
    kept = {value.name for value in quantizer.model.model.graph.input}
    lost = [value.name for value in lora_inputs if value.name not in kept]
    if lost:
        raise RuntimeError(f"int8 quantization removed {len(lost)} LoRA inputs (e.g. {lost[0]}); the export would take no adapter")
    for leftover in (model_path, Path(f"{model_path}.data")):
        leftover.unlink(missing_ok=True)
    quantizer.model.save_model_to_file(str(model_path), use_external_data_format=True)
    produced = Path(f"{model_path}.data")
    if not produced.is_file():  # the quantizer names its data file after the model file
        candidates = [p for p in folder.glob("*.data") if p.name != produced.name]
        if candidates:
            candidates[0].rename(produced)


def _write_bridge(folder: Path, bridge: Any) -> dict:
    """The bridge's tables as plain arrays, so an app maps drafter ids to target ids without Python objects."""
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "d2t.npy", np.asarray(bridge.d2t_list, dtype=np.int64))
    np.save(folder / "t2d.npy", bridge.t2d.numpy().astype(np.int64))
    data = [b or b"" for b in bridge.d.token_bytes]
    np.save(folder / "token_offsets.npy", np.cumsum([0] + [len(b) for b in data]).astype(np.int64))
    np.save(folder / "token_bytes.npy", np.frombuffer(b"".join(data), dtype=np.uint8))
    return {"target_vocab_size": int(bridge.target_vocab_size), "intersection": int(bridge.intersection_size)}


def _arch_fingerprint(model: Any) -> str:
    from omnidraft.adapter.store import architecture_fingerprint

    return architecture_fingerprint(model)


def _versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "transformers": transformers.__version__}


def _remove_export(folder: Path) -> None:
    """Replace an export omnidraft wrote (never anything else)."""
    try:
        kind = json.loads((folder / MANIFEST).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind != "omnidraft-onnx-drafter":
        raise OmnidraftError(f"{folder} exists and is not an export omnidraft wrote; move it away or give --out")
    shutil.rmtree(folder)


# ---- adapters


def read_manifest(folder: Path) -> dict:
    """The manifest of an export folder, checked; one line for a missing, damaged or foreign one."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OmnidraftError(f"{folder} is not an omnidraft export (no {MANIFEST}); run `omnidraft export`") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise OmnidraftError(f"the export manifest {path} is unreadable ({exc.__class__.__name__}); export again") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != "omnidraft-onnx-drafter" or manifest.get("format") != FORMAT:
        raise OmnidraftError(f"{folder} is not an omnidraft export of format {FORMAT}; export again")
    model = Path(folder) / MODEL
    if not model.is_file() or not Path(f"{model}.data").is_file():
        raise OmnidraftError(f"the export {folder} is incomplete ({MODEL} or its weights are missing); export again")
    return manifest


def export_adapter(loaded: Any, folder: Path, name: str) -> Path:
    """A trained adapter (``adapter.store.LoadedAdapter``) as ``adapters/<name>.onnx_adapter`` in an
    export folder, α/r folded into B, checked against the graph's LoRA inputs; its head beside it."""
    import onnxruntime as ort

    from omnidraft.adapter.merge import lora_pairs

    manifest = read_manifest(folder)
    arch = loaded.meta.get("identity", {}).get("drafter_arch")
    if arch and arch != manifest["architecture"]:
        raise OmnidraftError(f"adapter {loaded.path} was trained for another drafter than the export in {folder}")
    params = {}
    try:
        pairs = lora_pairs(loaded.state)
    except ValueError as exc:
        raise OmnidraftError(f"adapter {loaded.path}: {exc}") from None
    for module, (a, b) in pairs.items():
        shape = manifest["lora"].get(module)
        if shape is None or tuple(a.shape[1:]) != (shape["in"],) or b.shape[0] != shape["out"] or a.shape[0] != b.shape[1]:
            raise OmnidraftError(f"adapter {loaded.path} does not fit the export in {folder} (module {module})")
        params[f"{module}.lora_A.weight"] = ort.OrtValue.ortvalue_from_numpy(a.float().t().contiguous().numpy())
        params[f"{module}.lora_B.weight"] = ort.OrtValue.ortvalue_from_numpy((b.float() * loaded.scaling).t().contiguous().numpy())
    out_dir = Path(folder) / "adapters"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"{name}.onnx_adapter"
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(int(loaded.version))
    fmt.set_model_version(1)
    fmt.set_parameters(params)
    with tempfile.NamedTemporaryFile(dir=out_dir, prefix=f".{name}-", suffix=".tmp", delete=False) as fh:
        tmp = Path(fh.name)
    try:
        fmt.export_adapter(str(tmp))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    if loaded.head_state is not None:
        np.savez(out_dir / f"{name}.head.npz", **{k: v.numpy() for k, v in loaded.head_state.items()})
    manifest["adapters"][name] = {"file": f"adapters/{path.name}", "version": loaded.version,
                                  "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                  "head": loaded.head_state is not None}
    atomic_write_json(Path(folder) / MANIFEST, manifest)
    return path
