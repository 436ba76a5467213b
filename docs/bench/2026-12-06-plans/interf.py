"""Does load on core 1 slow llama.cpp steps on core 0? Times 60 plain steps per condition."""
import os, sys, time, subprocess, statistics
os.sched_setaffinity(0, {0})
from llama_cpp import Llama
m = Llama(sys.argv[1], n_ctx=512, n_threads=1, n_batch=64, verbose=False, logits_all=False)
toks = m.tokenize(b"def quicksort(arr):\n    ")
def run():
    m.reset(); m.eval(toks); ts = []
    for _ in range(60):
        t = time.perf_counter(); m.eval([int(m.scores[m.n_tokens - 1].argmax())]) if False else m.eval([220]); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1000
LOADS = {
  "idle": None,
  "alu": "import os;os.sched_setaffinity(0,{1})\nx=0\nwhile True: x=(x*3+1)%1000003",
  "mem": "import os,numpy as np;os.sched_setaffinity(0,{1})\na=np.ones(64<<20,dtype=np.float32)\nwhile True: a.sum()",
  "matmul": "import os,numpy as np;os.sched_setaffinity(0,{1});os.environ['OMP_NUM_THREADS']='1'\na=np.ones((512,512),dtype=np.float32)\nwhile True: a@a",
}
for rep in range(2):
    for name, code in LOADS.items():
        p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}) if code else None
        time.sleep(1.0)
        print(f"{name:7s} {run():.1f} ms/step", flush=True)
        if p: p.kill(); p.wait()
