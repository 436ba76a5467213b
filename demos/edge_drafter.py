"""What an app embeds: the exported drafter on onnxruntime, with numpy and `tokenizers` only.

    python demos/edge_drafter.py EXPORT_DIR "def fibonacci(n):" [--k 8] [--adapter FILE.onnx_adapter] [--target NAME]

No torch, no transformers, no omnidraft import: an Android, iOS or C++ app does the same with its
platform's onnxruntime and tokenizer bindings (export/README.md lists the inputs in order). It
drafts k tokens greedily from the drafter's own KV cache, then maps them to the target's token ids
with the exported bridge table (bridge/<target>/d2t.npy: drafter id -> target id, -1 where the
target has no token with the same bytes).

Token healing: a prompt that ends where the target's last token ended often ends in whitespace the
drafter's tokenizer would have joined with what follows ("):\n" then an indent, which SmolLM2 spells
as one "\n" + spaces token). The drafter then drafts from before that last token, its first token
restricted to those that begin with the token's bytes, and those bytes are dropped from the draft again
(they are the prompt's). omnidraft's own loop does the same (omnidraft/vocab/healing.py).
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
    bridges = sorted(p.name for p in (args.export / "bridge").iterdir()) if (args.export / "bridge").is_dir() else []
    target = args.target or (bridges[0] if bridges else None)
    token_bytes = drafter_token_bytes(args.export / "bridge" / target) if target else None
    ids = tokenizer.encode(args.prompt).ids
    healed = heal(ids[-1], token_bytes) if token_bytes and len(ids) > 1 else None
    overlap, allowed = healed if healed else (b"", None)
    drafted = []
    feed = np.asarray([ids[:-1] if healed else ids], dtype=np.int64)  # the prompt once (prefill), then one token per step
    for _ in range(args.k):
        logits, hidden, *presents = session.run(None, {"input_ids": feed, **past}, run_options)
        past = dict(zip(kv_names, presents))  # a rewind is only a shorter past: present[:, :, :n]
        row = logits[0, -1]  # logits: [1, 1, vocab], the last position
        token = int(allowed[row[allowed].argmax()]) if allowed is not None and not drafted else int(row.argmax())
        drafted.append(token)
        feed = np.asarray([[token]], dtype=np.int64)

    print(f"prompt: {args.prompt!r}" + (f" (healed: drafted from before its last token {overlap!r})" if healed else ""))
    print(f"drafted {len(drafted)} drafter tokens: {drafted} -> {tokenizer.decode(drafted)!r}")
    if target:
        d2t = np.load(args.export / "bridge" / target / "d2t.npy")
        head = [int(d2t[drafted[0]])]
        if overlap:  # a healed first token begins with the prompt's bytes: what it adds maps as the drafter token of those bytes
            rest = token_bytes[drafted[0]][len(overlap):]
            spelled = [i for i, data in enumerate(token_bytes) if data == rest] if rest else []
            head = [int(d2t[spelled[0]]) if spelled else -1] if rest else []
        mapped = head + [int(d2t[t]) for t in drafted[1:]]
        print(f"as {target} token ids (direct mapping, -1: spelled differently there): {mapped}")
    return 0


def drafter_token_bytes(bridge: Path) -> list[bytes]:
    """The drafter's tokens as bytes (the export writes them beside each bridge: offsets and one blob)."""
    offsets, blob = np.load(bridge / "token_offsets.npy"), np.load(bridge / "token_bytes.npy").tobytes()
    return [blob[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def heal(last: int, token_bytes: list[bytes]) -> tuple[bytes, np.ndarray] | None:
    """(the last token's bytes, the ids that begin with them) where the prompt's last token is whitespace
    that longer tokens extend; None otherwise (the prompt is drafted from as it is)."""
    data = token_bytes[last] if last < len(token_bytes) else b""
    if not data or data.strip():
        return None
    allowed = np.asarray([i for i, other in enumerate(token_bytes) if other.startswith(data)], dtype=np.int64)
    return (data, allowed) if len(allowed) > 1 else None


if __name__ == "__main__":
    sys.exit(main())
