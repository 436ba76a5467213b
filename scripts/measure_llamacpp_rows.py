"""Verify rows against one-token rows, and eval costs, of the llama.cpp target in this process.

Run once per build or setting (the llama.cpp library is chosen when the process starts), e.g.:

    python scripts/measure_llamacpp_rows.py qwen gemma                 # the installed (patched) build
    GGML_LLAMAFILE_MIN_ROWS=0 python scripts/measure_llamacpp_rows.py qwen   # the same build as released
    LLAMA_CPP_LIB_PATH=/path/to/other/lib python scripts/measure_llamacpp_rows.py qwen

It prints one JSON line: the largest |verify row - one-token row| over verifies of 1-16 proposals
after a 120-token prompt (read the way the decode loop reads it), the median ms to read a 400-token
prompt (3 reads) and of evals of k tokens after 200 cached ones (5 each). Models come from the home
($OMNIDRAFT_HOME, default .test_home). docs/performance.md has the numbers.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from omnidraft import models
from omnidraft.target import llamacpp
from omnidraft.target.llamacpp import LlamaCppTarget

SPECS = {"qwen": "builtin:qwen2.5-coder-0.5b", "gemma": "builtin:gemma3-270m", "qwen1.5b": "builtin:qwen2.5-coder-1.5b"}


def median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(target: LlamaCppTarget, ids: list[int]) -> dict:
    ctx = ids[:120]
    worst = 0.0
    for m in range(1, 17):
        seq = ids[:121 + m]  # the prompt read, then a verify of the next token and m proposals
        target.reset(); target.score(ctx, 0); batched = target.score(seq, m)
        target.reset(); target.score(ctx, 0)
        single = torch.cat([target.score(seq[:i], 0) for i in range(121, 122 + m)])
        worst = max(worst, (batched - single).abs().max().item())

    def read() -> None:
        target.reset()
        target.score(ids[:400], 0)

    out = {"batch_invariant": target.batch_invariant, "max_abs_diff": worst, "read400_ms": median_ms(read, 3)}
    for k in (1, 2, 5, 9, 17):
        target.reset()
        target.score(ids[:200], 0)

        def ev() -> None:
            target.score(ids[:200 + k], k - 1)
            target.trim(200)

        out[f"eval{k}_ms"] = median_ms(ev, 5)
    return out


def main(names: list[str]) -> None:
    home = os.environ.get("OMNIDRAFT_HOME", str(Path(__file__).resolve().parents[1] / ".test_home"))
    text = Path(llamacpp.__file__).read_text()  # any long text: a source file
    result: dict = {"env": {k: v for k, v in os.environ.items() if k.startswith(("GGML", "LLAMA_CPP"))}}
    for name in names:
        tok = models.load_tokenizer(SPECS[name], home, progress=False)
        target = LlamaCppTarget(models.gguf_of(SPECS[name], home, progress=False), tok)
        result[name] = measure(target, list(tok.encode(text)))
        target.close()
    result["tinyblas_min_rows"] = llamacpp._TINYBLAS_MIN_ROWS
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen", "gemma"])
