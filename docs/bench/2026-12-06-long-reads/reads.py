"""The native drafter's read of n tokens from an empty cache: integer products, float32 long reads, AMX long
reads; median of 3, and the largest logit difference from the integer read."""
import statistics, time, os
from pathlib import Path
import torch
from omnidraft import kernels, models
import omnidraft.drafter.native_lm as nl
ext = kernels.qdraft()
lm = nl.NativeDraftLM(nl.load_native_model(models.gguf_of("builtin:smollm2-135m", Path(os.environ["OMNIDRAFT_HOME"]), progress=False)))
ids = list(range(1000, 2100))  # arbitrary token ids: the cost does not depend on them
def read(n, reps=3):
    ts = []
    for _ in range(reps):
        lm.reset(); s = time.perf_counter(); out = lm.logits_for(ids[:n]).clone(); ts.append(time.perf_counter() - s)
    return 1e3 * statistics.median(ts), out
for n in (8, 16, 24, 32, 48, 64, 118, 256, 512, 1024):
    res = {}
    for name, lr, amx in (("int", 0, False), ("f32", 16, False), ("amx", 16, True)):
        ext.long_read_rows(lr); ext.use_amx(amx)
        res[name] = read(n)
    ref = res["int"][1]
    print(n, " ".join(f"{k} {v[0]:.1f} ms (max diff {float((v[1]-ref).abs().max()):.3f})" for k, v in res.items()))
