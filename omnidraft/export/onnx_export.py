"""``omnidraft export``: the drafter as an ONNX graph an app runs with onnxruntime alone.

One folder per (drafter, quant) under ``<home>/export/``:

    model.onnx              the decoder (``graph.FlatDrafter``): KV-cache inputs/outputs, last-position
                            logits and hidden state, LoRA weights as inputs with empty defaults
    model.onnx.data         its weights (external data, so the graph stays small to parse)
    tokenizer.json …        the drafter's tokenizer files
    bridge/<target>/        the vocabulary bridge per target: d2t.npy (drafter id -> target id, -1: none),
                            t2d.npy, token_bytes.npy + token_offsets.npy (each drafter token's bytes)
    adapters/<pair>.<sha>.onnx_adapter   trained adapters (onnxruntime.AdapterFormat, α/r folded into B)
    adapters/<pair>.<sha>.head.npz       their acceptance heads
    manifest.json           drafter identity and sha256, opset, quant, inputs/outputs, adapters, targets, versions
    genai_config.json       the same graph described for onnxruntime-genai (its Generator, its Adapters
                            API for the .onnx_adapter files), what its Android and iOS packages load

The exporter is the TorchScript-based ``torch.onnx.export`` around the flat module: it gives full
control over names and dynamic axes (prefill and one-token steps share one graph; the LoRA rank is
dynamic), and optimum does not support transformers 5, while onnxruntime-genai's builder bakes
LoRA in as fixed weights. int8 is 8-bit block-wise weights for the base MatMuls only (the LoRA
MatMuls, which see tiny and changing weights, stay float).

Writing goes through ``export.folder``: the graph export into a temporary sibling swapped in under
the export's lock (a kill leaves the old export or the new one), an adapter's files under new
names that only the manifest's atomic replace makes current (a kill leaves the old pair of adapter
and manifest or the new one), and one permission policy for every file.
"""

from __future__ import annotations

import copy

import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from omnidraft.errors import OmnidraftError
from omnidraft.export.folder import check_replaceable, commit, holding, new_temp, recover, set_modes
from omnidraft.export.manifest import (
    ADAPTER_SUFFIX,
    ADAPTERS_DIR,
    FORMAT,
    GENAI_CONFIG,
    HEAD_SUFFIX,
    KIND,
    MANIFEST,
    MODEL,
    QUANTS,
    adapter_files,
    check_graph,
    check_name,
    onnx_signature,
    read_manifest,
)
from omnidraft.fsutil import atomic_write_json, fsync_dir, fsync_tree

OPSET = 17
ATTENTIONS = ("fused", "plain")  # export_drafter's attention: onnxruntime's GroupQueryAttention node, or standard ops
__all__ = ["FORMAT", "MANIFEST", "MODEL", "QUANTS", "export_adapter", "export_dir", "export_drafter", "install",
           "read_manifest", "write_adapter"]


def export_dir(home_root: Path, drafter_slug: str, quant: str) -> Path:
    return home_root / "export" / f"{drafter_slug}-{quant}"


def export_drafter(model: Any, tokenizer: Any, out: Path, *, quant: str = "fp32", spec: str = "",
                   model_sha256: str = "", bridges: dict[str, Any] | None = None, progress: bool = True,
                   merged: Any = None, attention: str = "fused") -> Path:
    """Write the export folder ``out``: built in a temporary sibling, then swapped in (:func:`install`).

    ``attention``: "fused" is onnxruntime's ``com.microsoft::GroupQueryAttention`` (rotary and the
    causal mask inside one node per layer; in every standard onnxruntime build, and what
    onnxruntime-genai's own builder writes); "plain" spells it in standard ONNX operators, for a
    runtime built without the contrib operators. Both give the same logits (a test checks it).

    ``merged``: a trained adapter (``adapter.store.LoadedAdapter``) merged into the weights, W + (α/r)·B·A,
    with no LoRA inputs in the graph: one target's drafter at the base graph's cost per token (the
    LoRA branches are fp32 matmuls beside the quantized ones), taking no other adapter.

    The export's lock is held throughout, so a second export of the same folder is refused at once
    instead of after a minute of work, and nothing it leaves is taken for a dead writer's."""
    if quant not in QUANTS:
        raise OmnidraftError(f"unknown --quant {quant!r}; choose one of {', '.join(QUANTS)}")
    if attention not in ATTENTIONS:
        raise OmnidraftError(f"unknown --attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
    out = Path(out)
    with holding(out):
        recover(out)
        check_replaceable(out)  # before the long export, not after it
        tmp = new_temp(out)
        try:
            _build(model, tokenizer, tmp, quant=quant, spec=spec, model_sha256=model_sha256, bridges=bridges or {},
                   merged=merged, attention=attention)
            install(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def install(tmp: Path, out: Path) -> Path:
    """Make the complete export folder ``tmp`` (a sibling of ``out``) the export at ``out``: finish
    what an interrupted writer left, apply the permission policy, make every byte durable, then
    swap atomically (``folder.commit``)."""
    with holding(out):
        recover(out)
        check_replaceable(out)
        set_modes(tmp)
        fsync_tree(tmp)
        commit(tmp, out)
    return out


def _build(model: Any, tokenizer: Any, tmp: Path, *, quant: str, spec: str, model_sha256: str,
           bridges: dict[str, Any], merged: Any = None, attention: str = "fused") -> None:
    """Every file of an export into the empty folder ``tmp``; the manifest last, so a folder with a
    manifest is a complete one."""
    import onnx
    import torch

    from omnidraft.export.graph import FlatDrafter

    arch = _arch_fingerprint(model)  # before a merge changes the weights (names and shapes stay)
    if merged is not None:
        from omnidraft.adapter.merge import MergedLora

        trained_for = merged.meta.get("identity", {}).get("drafter_arch")
        if trained_for and trained_for != arch:
            raise OmnidraftError(f"adapter {merged.path} was trained for another drafter than {spec or 'this one'}")
        model = copy.deepcopy(model)
        try:
            MergedLora(model).apply(merged.state, merged.scaling)
        except ValueError as exc:
            raise OmnidraftError(f"cannot merge {merged.path}: {exc}") from None
    flat = FlatDrafter(model, lora=merged is None, fused=attention == "fused").eval()
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
                          dynamic_axes=dynamic, opset_version=OPSET, dynamo=False, do_constant_folding=True,
                          autograd_inlining=False)  # the fused attention goes through its symbolic, untraced
    graph = onnx.load(str(raw))
    _empty_lora_defaults(graph, flat)
    _declare_output_shapes(graph, flat, model)
    final = tmp / MODEL
    onnx.save(graph, str(final), save_as_external_data=True, all_tensors_to_one_file=True,
              location=f"{MODEL}.data", size_threshold=1024)
    raw.unlink()
    if quant == "int8":
        _quantize_int8(final, tmp)
    tokenizer.save_pretrained(tmp)
    targets = {name: _write_bridge(tmp / "bridge" / name, bridge) for name, bridge in bridges.items()}
    manifest = {
        "format": FORMAT, "kind": KIND, "drafter": spec, "drafter_sha256": model_sha256,
        "architecture": arch, "quant": quant, "opset": OPSET, "attention": attention,
        "layers": flat.layers, "kv_heads": flat.kv_heads, "head_dim": flat.head_dim,
        "hidden_size": int(model.config.hidden_size), "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
        "max_positions": int(model.config.max_position_embeddings),
        "inputs": names_in, "outputs": names_out,
        "lora": {m: {"in": i, "out": o} for m, (i, o) in _lora_shapes(flat).items()},
        "adapters": {}, "targets": targets, "created": time.time(), "versions": _versions(),
    }
    if merged is not None:  # what an app shows, and what refuses a second adapter
        manifest["merged_adapter"] = {"path": str(merged.path), "version": int(merged.version),
                                      "target": merged.meta.get("target")}
    atomic_write_json(tmp / GENAI_CONFIG, genai_config(manifest, model.config))
    atomic_write_json(tmp / MANIFEST, manifest)


def genai_config(manifest: dict, config: Any) -> dict:
    """The export described for onnxruntime-genai's ``og.Config``: a llama-type decoder with this
    graph's input and output names. The graph concatenates its past and the new keys (it takes no
    shared buffer) and has no attention mask input (one sequence, no padding), which genai allows."""
    def token_id(name: str) -> int | list[int] | None:
        value = getattr(config, name, None)
        return list(value) if isinstance(value, (list, tuple)) else value

    eos = token_id("eos_token_id")
    return {
        "model": {
            "type": "llama",
            "bos_token_id": token_id("bos_token_id"),
            "eos_token_id": eos,
            "pad_token_id": token_id("pad_token_id") if token_id("pad_token_id") is not None else eos,
            "context_length": manifest["max_positions"],
            "vocab_size": manifest["vocab_size"],
            "decoder": {
                "filename": MODEL,
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "head_size": manifest["head_dim"],
                "hidden_size": manifest["hidden_size"],
                "num_attention_heads": int(config.num_attention_heads),
                "num_key_value_heads": manifest["kv_heads"],
                "num_hidden_layers": manifest["layers"],
                "inputs": {"input_ids": "input_ids", "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        "search": {"do_sample": False, "num_beams": 1, "max_length": manifest["max_positions"],
                   "past_present_share_buffer": False},
    }


def _lora_shapes(flat) -> dict[str, tuple[int, int]]:
    """The graph's LoRA inputs: none in a graph with an adapter merged in."""
    return flat.lora_shapes() if flat.with_lora else {}


def _empty_lora_defaults(graph, flat) -> None:
    """Rank-0 initializers for every LoRA input: running with no adapter is exactly the base model."""
    from onnx import numpy_helper

    for module, (inp, out) in _lora_shapes(flat).items():
        for name, shape in ((f"{module}.lora_A.weight", (inp, 0)), (f"{module}.lora_B.weight", (0, out))):
            graph.graph.initializer.append(numpy_helper.from_array(np.zeros(shape, dtype=np.float32), name))


def _declare_output_shapes(graph, flat, model) -> None:
    """The outputs' element types and shapes, as every reader checks them (``manifest.check_graph``):
    ONNX shape inference does not know onnxruntime's contrib operators, so past the fused attention
    node the exporter leaves them unknown."""
    import onnx

    vocab, hidden = int(model.get_output_embeddings().weight.shape[0]), int(model.config.hidden_size)
    shapes: dict[str, list] = {"logits": [1, 1, vocab], "hidden": [1, hidden]}
    shapes.update({name: [1, flat.kv_heads, "total", flat.head_dim] for name in flat.output_names()[2:]})
    for output in graph.graph.output:
        tensor = output.type.tensor_type
        tensor.elem_type = onnx.TensorProto.FLOAT
        del tensor.shape.dim[:]
        for size in shapes[output.name]:
            dim = tensor.shape.dim.add()
            if isinstance(size, int):
                dim.dim_value = size
            else:
                dim.dim_param = size


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


# ---- adapters


def export_adapter(loaded: Any, folder: Path, name: str) -> Path:
    """A trained adapter (``adapter.store.LoadedAdapter``) as ``adapters/<name>.<sha>.onnx_adapter``
    in an export folder, α/r folded into B, its head beside it; returns the adapter file.

    The torch side: the adapter's tensors as the graph's LoRA inputs, checked against the manifest;
    :func:`write_adapter` checks the rest and writes."""
    check_name(name)
    folder = Path(folder)
    with holding(folder):
        recover(folder)
        manifest = read_manifest(folder)
        if manifest.get("merged_adapter"):
            raise OmnidraftError(f"the export in {folder} has an adapter merged into its weights; it takes no "
                                 f"other (export the drafter again without --merge-adapter)")
        arch = loaded.meta.get("identity", {}).get("drafter_arch")
        if arch and arch != manifest["architecture"]:
            raise OmnidraftError(f"adapter {loaded.path} was trained for another drafter than the export in {folder}")
        tensors = _adapter_tensors(loaded, manifest, folder)
        head = {k: v.numpy() for k, v in loaded.head_state.items()} if loaded.head_state is not None else None
        return write_adapter(folder, name, int(loaded.version), tensors, head)


def write_adapter(folder: Path, name: str, version: int, tensors: dict[str, np.ndarray],
                  head: dict[str, np.ndarray] | None = None) -> Path:
    """Add or replace the adapter ``name`` of an export: LoRA input tensors (graph input name ->
    array) as an ``.onnx_adapter``, the acceptance head's arrays beside it. No torch needed.

    Everything is checked before anything is written: ``name`` (one plain name), the whole manifest
    and the graph it describes, every tensor against the graph's LoRA inputs. The files get new
    names (their content's hash) and only the manifest's atomic replace makes them current; the
    files it no longer names are removed after it. A kill at any moment leaves the manifest and the
    files it names in agreement, the old pair or the new one; the next writer removes orphans.
    """
    import onnxruntime as ort

    check_name(name)
    folder = Path(folder)
    with holding(folder):
        recover(folder)
        manifest = read_manifest(folder)
        check_graph(manifest, folder, *onnx_signature(folder / MODEL))
        _check_tensors(tensors, manifest, folder)
        out_dir = _adapters_dir(folder)
        _sweep_adapters(out_dir, manifest)
        params = {key: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value, dtype=np.float32))
                  for key, value in tensors.items()}
        path = _write_adapter_file(out_dir, name, version, params)
        entry = {"file": f"{ADAPTERS_DIR}/{path.name}", "version": int(version),
                 "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "head": head is not None}
        if head is not None:
            entry["head_file"] = f"{ADAPTERS_DIR}/{_write_head_file(out_dir, name, head).name}"
        updated = dict(manifest, adapters={**manifest["adapters"], name: entry})
        atomic_write_json(folder / MANIFEST, updated)  # the commit point
        set_modes(folder / MANIFEST)
        _sweep_adapters(out_dir, updated)
    return path


def _adapter_tensors(loaded: Any, manifest: dict, folder: Path) -> dict[str, np.ndarray]:
    """The graph's LoRA inputs for a peft adapter: Aᵀ and Bᵀ, α/r folded into B."""
    from omnidraft.adapter.merge import lora_pairs

    try:
        pairs = lora_pairs(loaded.state)
    except ValueError as exc:
        raise OmnidraftError(f"adapter {loaded.path}: {exc}") from None
    tensors = {}
    for module, (a, b) in pairs.items():
        if module not in manifest["lora"] or a.dim() != 2 or b.dim() != 2:
            raise OmnidraftError(f"adapter {loaded.path} does not fit the export in {folder} (module {module})")
        tensors[f"{module}.lora_A.weight"] = a.float().t().contiguous().numpy()
        tensors[f"{module}.lora_B.weight"] = (b.float() * loaded.scaling).t().contiguous().numpy()
    return tensors


def _check_tensors(tensors: dict[str, np.ndarray], manifest: dict, folder: Path) -> None:
    """Each tensor is a LoRA input of the graph with its shape ([in, r] for A, [r, out] for B, one
    rank per module), finite; one line naming the first that is not."""
    ranks: dict[str, int] = {}
    for key, value in tensors.items():
        module, _, which = key.rpartition(".lora_")
        shape = manifest["lora"].get(module)
        ok = shape is not None and which in ("A.weight", "B.weight") and getattr(value, "ndim", 0) == 2
        if ok:
            rank = value.shape[1] if which == "A.weight" else value.shape[0]
            fixed = value.shape[0] if which == "A.weight" else value.shape[1]
            ok = fixed == shape["in" if which == "A.weight" else "out"] and ranks.setdefault(module, rank) == rank
        if not ok or not np.isfinite(value).all():
            raise OmnidraftError(f"adapter tensor {key} does not fit the export in {folder}")
    unpaired = [m for m in ranks if sum(k.startswith(f"{m}.lora_") for k in tensors) != 2]
    if not tensors or unpaired:
        raise OmnidraftError(f"the adapter for {folder} has no tensors or an A without its B ({unpaired[:1]})")


def _adapters_dir(folder: Path) -> Path:
    """``<export>/adapters``, a real folder inside the export (never a link that leads elsewhere)."""
    out_dir = folder / ADAPTERS_DIR
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise OmnidraftError(f"{out_dir} is not a folder of the export (a link or a file); export again")
    if not out_dir.exists():
        out_dir.mkdir()
        set_modes(out_dir)
    return out_dir


def _publish_file(out_dir: Path, name: str, suffix: str, write: Callable[[Path], None]) -> Path:
    """Write a file with ``write(path)`` to a temporary name, make it durable and readable, then
    rename it to ``<name>.<sha256[:16]><suffix>``: a name the current manifest cannot hold unless
    the content is the same, so the manifest goes on naming intact files until it is replaced."""
    fd, tmp_name = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()
            os.fsync(fh.fileno())
        set_modes(tmp)
        final = out_dir / f"{name}.{digest[:16]}{suffix}"
        os.replace(tmp, final)
        fsync_dir(out_dir)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def _write_adapter_file(out_dir: Path, name: str, version: int, params: dict) -> Path:
    import onnxruntime as ort

    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(int(version))
    fmt.set_model_version(1)
    fmt.set_parameters(params)
    return _publish_file(out_dir, name, ADAPTER_SUFFIX, lambda path: fmt.export_adapter(str(path)))


def _write_head_file(out_dir: Path, name: str, head: dict[str, np.ndarray]) -> Path:
    def write(path: Path) -> None:
        with open(path, "wb") as fh:  # a file object: np.savez would append .npz to a name
            np.savez(fh, **head)

    return _publish_file(out_dir, name, HEAD_SUFFIX, write)


_OWNED_ADAPTER_FILE = re.compile(rf"^(.+({re.escape(ADAPTER_SUFFIX)}|{re.escape(HEAD_SUFFIX)})|\..+\.tmp)$")


def _sweep_adapters(out_dir: Path, manifest: dict) -> None:
    """Remove the adapter files (and temporary files) of ``adapters/`` that ``manifest`` does not
    name: what a killed writer left, or what the entry just written replaced. Files with other
    names are not omnidraft's and stay."""
    named = {Path(rel).name for entry in manifest["adapters"].values() for rel in adapter_files(entry)}
    for path in out_dir.iterdir():
        if path.name not in named and _OWNED_ADAPTER_FILE.match(path.name) and (path.is_file() or path.is_symlink()):
            path.unlink(missing_ok=True)
