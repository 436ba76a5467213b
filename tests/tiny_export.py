"""Tiny real exports (a 1-layer random Llama through the real exporter, 100 KB) and a writer that
can be SIGKILLed at its N-th filesystem step, for the export's crash-safety tests.

The real drafter's graph export takes ~40 s; these take a second or two, and the replace routine
they go through is the one every export uses (``onnx_export.install``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PROBE = [1, 2, 3, 4]  # token ids whose next-token logits tell two exports apart

# A writer in a child process that can die at any filesystem step. MODE "export": `omnidraft
# export`'s last stage over an existing export: it holds the export's lock, writes the new export
# file by file into a temporary sibling (the manifest last, as the exporter does) and installs it.
# MODE "adapter": `export --adapter` (``write_adapter``) of the tensors in an .npz file. Every
# filesystem step (rename, replace, unlink, rmdir, mkdir, fsync, chmod, each file copied) is
# counted; at step KILL_AT the child SIGKILLs itself, with no chance to clean up. KILL_AT 0: never;
# then it prints one line per step (what it was called on), so a test can aim at a step.
WRITER = r"""
import json, os, shutil, signal, sys
from pathlib import Path

mode, src, out, kill_at = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
trace = []

def step(what):
    trace.append(what)
    if len(trace) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

def counted(name, fn):
    def call(*args, **kwargs):
        step(f"{name} {Path(str(args[0])).name if args and isinstance(args[0], (str, os.PathLike)) else ''}")
        return fn(*args, **kwargs)
    return call

import numpy as np
from omnidraft.export.folder import holding, new_temp
from omnidraft.export.onnx_export import install, write_adapter

for name in ("rename", "replace", "unlink", "rmdir", "mkdir", "fsync", "chmod"):
    setattr(os, name, counted(name, getattr(os, name)))
if mode == "export":
    with holding(out):
        tmp = new_temp(out)
        files = sorted(p for p in src.rglob("*") if p.is_file())
        for path in sorted(files, key=lambda p: p.name == "manifest.json"):
            (tmp / path.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            step(f"write {path.name}")
            shutil.copyfile(path, tmp / path.relative_to(src))
        install(tmp, out)
else:
    arrays = dict(np.load(src))
    head = {k[5:]: v for k, v in arrays.items() if k.startswith("head:")}
    write_adapter(out, "d--t", int(arrays.pop("version")), {k: v for k, v in arrays.items() if ":" not in k and k != "version"},
                  head or None)
print("\n".join(trace))
"""


def build(root: Path, seed: int, quant: str = "fp32") -> Path:
    """A tiny drafter (random weights from ``seed``) exported by the real exporter to ``root/seed-<seed>``."""
    from tiny import tiny_model, tiny_tokenizer

    from omnidraft.export.onnx_export import export_drafter

    tok = tiny_tokenizer(330)
    return export_drafter(tiny_model(len(tok), seed), tok, root / f"seed-{seed}-{quant}", quant=quant, spec=f"tiny-{seed}")


def probe(folder: Path) -> np.ndarray:
    """The export's next-token logits after :data:`PROBE`, through the onnxruntime backend."""
    from omnidraft.drafter.onnx_lm import OrtCausalLM

    return OrtCausalLM(folder, threads=1).logits_for(PROBE)


def copy_export(src: Path, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, out)
    return out


def run_writer(src: Path, out: Path, kill_at: int = 0, mode: str = "export") -> subprocess.CompletedProcess:
    """In a child process killed at step ``kill_at`` (0: never): install a copy of the export ``src``
    at ``out`` (mode "export"), or write the adapter saved in the .npz ``src`` into ``out`` ("adapter")."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", WRITER, mode, str(src), str(out), str(kill_at)], env=env,
                          capture_output=True, text=True, timeout=120)


def save_adapter(path: Path, manifest: dict, version: int, seed: int, rank: int = 2) -> Path:
    """Random LoRA input tensors for the export's modules (and a head) as an .npz the writer reads."""
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {"version": np.array(version), "head:w": rng.normal(size=(4, 3)).astype(np.float32)}
    for module, shape in manifest["lora"].items():
        arrays[f"{module}.lora_A.weight"] = (rng.normal(size=(shape["in"], rank)) * 0.1).astype(np.float32)
        arrays[f"{module}.lora_B.weight"] = (rng.normal(size=(rank, shape["out"])) * 0.1).astype(np.float32)
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)
    return path


def adapter_state(folder: Path) -> dict[str, str]:
    """name -> sha256 of each adapter the manifest lists, checked against the files it names
    (AssertionError if a named file is missing or differs: manifest and files disagree)."""
    import hashlib
    import json

    manifest = json.loads((folder / "manifest.json").read_text())
    for name, entry in manifest["adapters"].items():
        data = (folder / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], (name, entry)
        if entry.get("head_file"):
            assert (folder / entry["head_file"]).is_file(), entry
    return {name: entry["sha256"] for name, entry in manifest["adapters"].items()}


def killed(proc: subprocess.CompletedProcess) -> bool:
    return proc.returncode == -signal.SIGKILL


def siblings(out: Path) -> list[str]:
    """Everything beside the export folder but the folder itself and its lock file."""
    return sorted(p.name for p in out.parent.iterdir() if p.name not in (out.name, f".{out.name}.lock"))


def tamper(manifest: dict, how: str) -> None:
    """Edit a manifest as a user or a damaged disk might (each edit is refused before use)."""
    first_module = next(iter(manifest["lora"]))
    edits = {
        "head_dim 63": lambda m: m.update(head_dim=m["head_dim"] - 1),
        "no layers": lambda m: m.pop("layers"),
        "one layer more": lambda m: m.update(layers=m["layers"] + 1),
        "layers as text": lambda m: m.update(layers=str(m["layers"])),
        "layers true": lambda m: m.update(layers=True),
        "kv_heads": lambda m: m.update(kv_heads=m["kv_heads"] * 2),
        "vocab_size": lambda m: m.update(vocab_size=m["vocab_size"] + 1),
        "hidden_size": lambda m: m.update(hidden_size=m["hidden_size"] + 8),
        "no lora": lambda m: m.pop("lora"),
        "lora features": lambda m: m["lora"][first_module].update({"in": m["lora"][first_module]["in"] + 1}),
        "lora module missing": lambda m: m["lora"].pop(first_module),
        "inputs reordered": lambda m: m.update(inputs=m["inputs"][::-1]),
        "outputs missing": lambda m: m.update(outputs=m["outputs"][:2]),
        "adapters list": lambda m: m.update(adapters=[]),
        "adapters null": lambda m: m.update(adapters=None),
        "adapter file outside": lambda m: m.update(adapters={"p--q": {"file": "../../../etc/passwd.onnx_adapter",
                                                                      "version": 1, "sha256": "0" * 64, "head": False}}),
        "adapter file missing": lambda m: m.update(adapters={"p--q": {"file": "adapters/p--q.onnx_adapter",
                                                                      "version": 1, "sha256": "0" * 64, "head": False}}),
        "quant": lambda m: m.update(quant="int3"),
        "max_positions negative": lambda m: m.update(max_positions=-5),
    }
    edits[how](manifest)


TAMPERS = ["head_dim 63", "no layers", "one layer more", "layers as text", "layers true", "kv_heads", "vocab_size",
           "hidden_size", "no lora", "lora features", "lora module missing", "inputs reordered", "outputs missing",
           "adapters list", "adapters null", "adapter file outside", "adapter file missing", "quant",
           "max_positions negative"]
