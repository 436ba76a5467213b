"""Native drafter steps after a 200-token context, whole head against the pruned head (the default's rows on a
fresh home: the first third of the ids and the context's tokens), each 4-step run after a 1 GiB sweep (what a
target's verify does to the caches) and warm; medians of 8 runs x 3 rounds, ms, in one process."""
import statistics, time, os
import torch
from omnidraft import models
from omnidraft.drafter.native_lm import load_native_model, NativeDraftLM

home = os.environ["OMNIDRAFT_HOME"]
weights = load_native_model(models.gguf_of("builtin:smollm2-135m", home, progress=False))
tok = models.load_tokenizer("builtin:smollm2-135m", home, progress=False)
from omnidraft.data import load_prompts
text = " ".join(p.text for p in load_prompts("humaneval", n=4, offset=100, home=home))
ids = tok.encode(text)[:240]
big = torch.randn(256 * 1024 * 1024)
arms = {}
for name, prune in (("whole head", False), ("pruned head", True)):
    lm = NativeDraftLM(weights)
    lm.prune_head = prune
    lm.logits_for(ids[:200])
    arms[name] = lm
print("kept rows:", int(weights.head_vocab.kept.sum()), "of", weights.vocab_size)


def run(lm, sweep: bool, n: int = 8, steps: int = 4) -> list[float]:
    times = [[] for _ in range(steps)]
    for _ in range(n):
        if sweep:
            big.sum()
        for j in range(steps):
            start = time.perf_counter()
            lm.step(ids[200 + j])
            times[j].append(time.perf_counter() - start)
        del lm.cached_ids[-steps:]
    return [statistics.median(t) * 1e3 for t in times]


results = {(name, sweep): [] for name in arms for sweep in (True, False)}
for _ in range(3):
    for (name, sweep), out in results.items():
        out.append(run(arms[name], sweep))
for (name, sweep), out in results.items():
    cols = [statistics.median(c) for c in zip(*out)]
    print(f"{name:12s} {'after a sweep' if sweep else 'warm':14s} steps 1-4: " + " ".join(f"{c:.2f}" for c in cols)
          + f"  (mean {statistics.mean(cols):.2f})")
