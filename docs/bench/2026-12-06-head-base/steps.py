"""Native drafter steps after a 200-token context with three heads: whole, the kept rows on the first third's base,
and the kept rows on the shipped base (the first third and the sampled words); each 4-step run after a 1 GiB sweep
(what a target's verify does to the caches) and warm; medians of 8 runs x 3 rounds, ms, in one process."""
import statistics, time, os
import torch
from omnidraft import models
from omnidraft.data import load_prompts
from omnidraft.drafter.native_lm import HeadVocab, NativeDraftLM, load_native_model

home = os.environ["OMNIDRAFT_HOME"]
gguf = models.gguf_of("builtin:smollm2-135m", home, progress=False)
tok = models.load_tokenizer("builtin:smollm2-135m", home, progress=False)
text = " ".join(p.text for p in load_prompts("humaneval", n=4, offset=100, home=home))
ids = tok.encode(text)[:240]
big = torch.randn(256 * 1024 * 1024)
arms = {}
for name in ("whole head", "first third", "shipped"):
    weights = load_native_model(gguf)
    if name == "first third":
        object.__setattr__(weights, "head_vocab", HeadVocab(weights.model, weights.vocab_size))
    lm = NativeDraftLM(weights)
    lm.prune_head = name != "whole head"
    lm.logits_for(ids[:200])
    arms[name] = lm
    print(name, "kept rows:", int(weights.head_vocab.kept.sum()) if lm.prune_head else weights.vocab_size)


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
