"""(Needs `git apply onnx-head.patch` beside it: `omnidraft export --head-rows`, measured and not merged.) The int8 ONNX drafter with the whole head against kept head rows (two exports of the same drafter: `omnidraft
export --head-rows all|kept --out DIR`). One-token steps after a 200-token HumanEval context, warm and after a
1 GiB sweep (what a target's verify does to the caches), medians of 3 rounds x 24 steps, ms; and how often the two
exports' top tokens agree, teacher-forced on prompts the home had not read (HumanEval, AlpacaEval, zh 108-115)."""
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omnidraft import models
from omnidraft.data import load_prompts
from omnidraft.drafter.onnx_lm import OnnxDraftLM

home = os.environ["OMNIDRAFT_HOME"]
lms = {name: OnnxDraftLM(Path(folder)) for name, folder in zip(("whole head", "kept rows"), sys.argv[1:3])}
tok = models.load_tokenizer("builtin:smollm2-135m", home, progress=False)
ids = tok.encode(" ".join(p.text for p in load_prompts("humaneval", n=4, offset=100, home=home)))[:240]
big = torch.randn(256 * 1024 * 1024)


def steps(lm, sweep: bool) -> float:
    lm.reset()
    lm.logits_for(ids[:200])
    times = []
    for t in ids[200:224]:
        if sweep:
            big.sum()
        start = time.perf_counter()
        lm.step(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


for sweep in (False, True):
    got = {name: [steps(lm, sweep) for _ in range(3)] for name, lm in lms.items()}
    print("after a sweep" if sweep else "warm", {name: round(statistics.median(v), 2) for name, v in got.items()})
whole, kept = lms.values()
for name in ("humaneval", "alpaca", "zh"):
    same = total = 0
    for p in load_prompts(name, n=8, offset=108, home=home):
        text = tok.encode(p.text)[:256]
        whole.reset(); kept.reset()
        a, b = whole.logits_for(text[:1]).numpy(), kept.logits_for(text[:1]).numpy()
        for t in text[1:]:
            same += int(a.argmax() == b.argmax()); total += 1
            a, b = whole.step(t).numpy(), kept.step(t).numpy()
    print(name, f"top-1 agreement {same}/{total} = {same / total:.4f}")
