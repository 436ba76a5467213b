"""The native drafter's read of n tokens from an empty cache: integer products, float32 long reads, AMX long
reads; median of 3, and the largest logit difference from the integer read."""
import statistics, sys, time, os
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
ROWS = [int(x) for x in sys.argv[1:]] or [8, 16, 24, 32, 48, 64, 118, 256, 512, 1024]  # rows to read: argv or these
FROM = int(os.environ.get("LONG_FROM", 16))  # reads from this many rows take the long path
for n in ROWS:
    res = {}
    for name, lr, amx in (("int", 0, False), ("f32", FROM, False), ("amx", FROM, True)):
        ext.long_read_rows(lr); ext.use_amx(amx)
        res[name] = read(n)
    ref = res["int"][1]
    print(n, " ".join(f"{k} {v[0]:.1f} ms (max diff {float((v[1]-ref)[torch.isfinite(ref)].abs().max()):.3f})" for k, v in res.items()))
