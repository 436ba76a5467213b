import time, statistics, torch
from omnidraft.runtime import load_pipeline
pipe = load_pipeline("builtin:qwen2.5-coder-0.5b", "builtin:smollm2-135m", engine="torch", adapter="none", drafter_backend="native", quiet=True)
lm = pipe.decoder.drafter.lm
ids = list(range(1000, 1600))
for n in (16, 200, 400):
    lm.reset(); lm.logits_for(ids[:n])
    ts = []
    for i in range(24):
        s = time.perf_counter(); lm.step(ids[n + i]); ts.append(time.perf_counter() - s)
    print(f"context {n}: step median {1000*statistics.median(ts[4:]):.2f} ms")
for rows in (1, 2, 4, 8, 16, 32, 64):
    ts = []
    for rep in range(3):
        lm.reset(); lm.logits_for(ids[:200])
        s = time.perf_counter(); lm.logits_for(ids[:200 + rows]); ts.append(time.perf_counter() - s)
    m = statistics.median(ts)
    print(f"read {rows} rows after 200: {1000*m:.2f} ms ({1000*m/rows:.2f}/row)")
