"""A torch target's prompt reads of 17-64 tokens (and verifies of 8-16 proposals) with the kernel candidates
before (torch's GEMMs only above 16 rows) and after (the native kernel in passes of at most 16 rows may be
chosen): one process, the arms alternating, each arm's kernels timed afresh; min of 3, ms."""
import sys, time
import torch
from omnidraft import fastlinear, runtime
from omnidraft.config import DecodeConfig
from omnidraft.target.base import LocalVerifier
from omnidraft.verify.proposal import Proposal

spec = sys.argv[1]
target, model, _ = runtime.load_target(spec, "torch", quiet=True)
v = LocalVerifier(target)
ids = target.tokenizer.encode("def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n" * 30)[:300]
greedy = DecodeConfig(verify="greedy")
new_candidates = fastlinear._candidates


def old_candidates(layer, flat, has_t):
    return [k for k in new_candidates(layer, flat, has_t) if not k.__name__.endswith("_passes")]


def arm(candidates) -> dict:
    fastlinear._candidates = candidates
    fastlinear._CHOICE.clear()
    fastlinear.prepare(model, range(1, 65))
    out = {}
    for n in (17, 24, 32, 48, 64):  # a read of n tokens from an empty cache
        ts = []
        for _ in range(3):
            v.reset(); t0 = time.perf_counter(); v.verify(ids[:n], None, greedy, None); ts.append(time.perf_counter() - t0)
        out[f"read {n}"] = 1e3 * min(ts)
    v.reset(); v.verify(ids[:200], None, greedy, None)
    for k in (0, 8, 15, 16):  # verifies after a 200-token context
        ts = []
        for _ in range(3):
            t0 = time.perf_counter(); v.verify(ids[:200], Proposal(ids[200:200 + k]) if k else None, greedy, None)
            ts.append(time.perf_counter() - t0)
        out[f"V({k})"] = 1e3 * min(ts)
    return out


results = {"before": [], "after": []}
for _ in range(2):
    for name, cands in (("before", old_candidates), ("after", new_candidates)):
        results[name].append(arm(cands))
print(spec, torch.get_num_threads(), "threads")
for name, runs in results.items():
    print(f"{name:7s}", "  ".join(f"{k} {min(r[k] for r in runs):.0f}" for k in runs[0]))
