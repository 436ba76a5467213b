"""A published LoRA adapter as llama.cpp's GGUF LoRA: what the llama.cpp drafter swaps in.

The trainer stays on torch and publishes peft tensors; the llama.cpp drafter cannot read those. This
module writes the same tensors in the layout ``llama_adapter_lora_init`` loads (llama.cpp's
``convert_lora_to_gguf.py`` is the reference):

- one ``<gguf name>.weight.lora_a`` / ``.lora_b`` pair per adapted Linear, named by gguf's own
  HF-to-GGUF tensor map, A as [rank, in] and B as [out, rank] (GGUF reverses numpy's axis order, so
  llama.cpp sees A with ne = (in, rank) and B with ne = (rank, out), the shapes it checks);
- no ``adapter.lora.alpha``: llama.cpp then multiplies B·A·x by the scale given when the adapter is
  set on a context (``llama_set_adapters_lora``), which is peft's α/r;
- for llama-architecture models, B's rows of ``q_proj`` and ``k_proj`` permuted the way the HF
  converter permuted the base weights' rows (rotary halves interleaved per head), since the GGUF's
  W_q is that permutation of the HF W_q and the LoRA delta must land on the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from omnidraft.adapter.merge import lora_pairs

# Architectures whose q/k rows llama.cpp's HF converter permutes (LlamaModel.permute).
ROPE_PERMUTED = frozenset({"llama"})


@dataclass(frozen=True)
class GgufShape:
    """What the tensor names and the q/k permutation depend on, read from the base GGUF."""

    architecture: str  # general.architecture, e.g. "llama"
    n_layers: int
    n_head: int
    n_head_kv: int


def rope_permute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """The HF converter's ``LlamaModel.permute`` on a tensor's leading (output) axis."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_tensors(state: dict[str, torch.Tensor], shape: GgufShape) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 tensor for every LoRA pair in ``state`` (peft key names)."""
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(shape.architecture)
    if arch is None:
        raise ValueError(f"gguf knows no architecture {shape.architecture!r}")
    names = gguf.get_tensor_name_map(arch, shape.n_layers)
    out: dict[str, torch.Tensor] = {}
    for path, (a, b) in lora_pairs(state).items():
        name = names.get_name(path)
        if name is None:
            raise ValueError(f"adapter module {path!r} has no tensor in a {shape.architecture} GGUF")
        b = b.float()
        if shape.architecture in ROPE_PERMUTED and path.endswith(("q_proj", "k_proj")):
            b = rope_permute(b, shape.n_head if path.endswith("q_proj") else shape.n_head_kv)
        out[f"{name}.weight.lora_a"] = a.float().contiguous()
        out[f"{name}.weight.lora_b"] = b.contiguous()
    return out


def write_gguf_lora(state: dict[str, torch.Tensor], shape: GgufShape, path: str | Path) -> None:
    """Write ``state`` as a GGUF LoRA file for a base model of ``shape`` (scale given at set time)."""
    writer = gguf.GGUFWriter(str(path), shape.architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    for name, tensor in gguf_tensors(state, shape).items():
        writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
