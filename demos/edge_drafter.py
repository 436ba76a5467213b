"""What an app embeds: the exported drafter on onnxruntime, with numpy and `tokenizers` only.

    python demos/edge_drafter.py EXPORT_DIR "def fibonacci(n):" [--k 8] [--adapter FILE.onnx_adapter] [--target NAME]

No torch, no transformers, no omnidraft import: an Android, iOS or C++ app does the same with its
platform's onnxruntime and tokenizer bindings (export/README.md lists the inputs in order). It
drafts k tokens greedily from the drafter's own KV cache, then maps them to the target's token ids
with the exported bridge table (bridge/<target>/d2t.npy: drafter id -> target id, -1 where the
target has no token with the same bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("export", type=Path, help="a folder written by `omnidraft export`")
    p.add_argument("prompt")
    p.add_argument("--k", type=int, default=8, help="tokens to draft")
    p.add_argument("--adapter", type=Path, default=None, help="an .onnx_adapter to activate (per request, same session)")
    p.add_argument("--target", default=None, help="a target under bridge/ to map the draft to (default: the first)")
    args = p.parse_args()

    manifest = json.loads((args.export / "manifest.json").read_text())
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the LoRA inputs have (empty) defaults on purpose: no warnings
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(str(args.export / "model.onnx"), options, providers=["CPUExecutionProvider"])
    run_options = ort.RunOptions()
    if args.adapter:
        adapter = ort.LoraAdapter()
        adapter.Load(str(args.adapter))
        run_options.add_active_adapter(adapter)
    tokenizer = Tokenizer.from_file(str(args.export / "tokenizer.json"))

    # Inputs, in the manifest's order: input_ids [1, s] int64, then past_key_values.{i}.key/.value for
    # every layer [1, kv_heads, past, head_dim] float32 (empty at the start); the LoRA inputs have
    # defaults (no adapter) and are left out unless an adapter is active.
    kv_names = [n for n in manifest["inputs"] if n.startswith("past_key_values.")]
    past = {n: np.zeros((1, manifest["kv_heads"], 0, manifest["head_dim"]), np.float32) for n in kv_names}
    ids = tokenizer.encode(args.prompt).ids
    drafted = []
    feed = np.asarray([ids], dtype=np.int64)  # the prompt once (prefill), then one token per step
    for _ in range(args.k):
        logits, hidden, *presents = session.run(None, {"input_ids": feed, **past}, run_options)
        past = dict(zip(kv_names, presents))  # a rewind is only a shorter past: present[:, :, :n]
        token = int(logits[0, -1].argmax())  # logits: [1, 1, vocab], the last position
        drafted.append(token)
        feed = np.asarray([[token]], dtype=np.int64)

    print(f"prompt: {args.prompt!r}")
    print(f"drafted {len(drafted)} drafter tokens: {drafted} -> {tokenizer.decode(drafted)!r}")
    bridges = sorted(p.name for p in (args.export / "bridge").iterdir()) if (args.export / "bridge").is_dir() else []
    target = args.target or (bridges[0] if bridges else None)
    if target:
        d2t = np.load(args.export / "bridge" / target / "d2t.npy")
        mapped = [int(d2t[t]) for t in drafted]
        print(f"as {target} token ids (direct mapping, -1: spelled differently there): {mapped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
