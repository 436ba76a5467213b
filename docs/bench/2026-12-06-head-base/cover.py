"""How often the fp32 drafter's top-1 lies in the kept head rows of a fresh home, two bases: the first third of the
ids, and the set shipped for the vocabulary (scripts/rank_head_rows.py: counted from the drafter's own samples).
Each also keeps every token read so far in the same text (what a first run keeps). Held-out prompts 100-123 of
each set, each position of the prompt teacher-forced, up to 512 tokens. The sets were never read by the ranking."""
import os, collections, glob
from pathlib import Path
import numpy as np
import torch
from omnidraft import models
from omnidraft.data import load_prompts
from omnidraft.drafter.native_lm import load_native_model
from transformers import AutoModelForCausalLM
home = Path(os.environ["OMNIDRAFT_HOME"])
tok = models.load_tokenizer("builtin:smollm2-135m", home, progress=False)
weights = load_native_model(models.gguf_of("builtin:smollm2-135m", home, progress=False))
shipped = weights.head_vocab.kept.copy()
mdir = glob.glob(str(home / "models/smollm2-135m-*"))[0]
model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
V = model.config.vocab_size
first_third = np.arange(V) < V // 3
print("rows: first third", int(first_third.sum()), "shipped", int(shipped.sum()))
torch.set_grad_enabled(False)
for d in ("humaneval", "alpaca", "zh", "codeedit", "xsum"):
    prompts = load_prompts(d, n=24, offset=100, home=home)
    stats = collections.Counter(); n = 0
    for p in prompts:
        ids = tok.encode(p.text)[:512]
        am = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        seen = set()
        for t, a in zip(ids, am):
            seen.add(t); n += 1
            for name, base in (("first third", first_third), ("shipped", shipped)):
                stats[name] += bool(base[a])
                stats[name + " + read"] += bool(base[a]) or a in seen
    print(d, n, {k: f"{v / n:.4f}" for k, v in sorted(stats.items())})
