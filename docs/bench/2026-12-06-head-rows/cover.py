"""How often the fp32 drafter's top-1 lies in a pruned head's kept set, three ways of choosing the set: the first N ids
(a BPE vocabulary's earliest merges); those and every token read so far in the same text (what a first run keeps);
those and every token of 64 other prompts of each set (a home that has read them). Held-out prompts 100-123, each
position of the prompt teacher-forced, up to 512 tokens."""
import os, collections, glob
from pathlib import Path
import torch
from omnidraft import models
from omnidraft.data import load_prompts
from transformers import AutoModelForCausalLM
home = Path(os.environ["OMNIDRAFT_HOME"])
tok = models.load_tokenizer("builtin:smollm2-135m", home, progress=False)
mdir = glob.glob(str(home / "models/smollm2-135m-*"))[0]
model = AutoModelForCausalLM.from_pretrained(mdir, torch_dtype=torch.float32).eval()
V = model.config.vocab_size
torch.set_grad_enabled(False)
def argmaxes(ids):
    out = model(torch.tensor([ids])).logits[0]
    return out.argmax(-1).tolist()
domains = ("humaneval", "alpaca", "zh", "codeedit")
history = collections.Counter()  # a home's counts: the texts of prompts 0-63 of every domain
for d in domains:
    for p in load_prompts(d, n=64, offset=0, home=home):
        history.update(tok.encode(p.text)[:512])
print("tokens seen in history:", len(history))
for d in domains:
    prompts = load_prompts(d, n=24, offset=100, home=home)
    stats = collections.Counter(); n = 0
    for p in prompts:
        ids = tok.encode(p.text)[:512]
        am = argmaxes(ids)
        seen = set()
        for t, a in zip(ids, am):
            seen.add(t); n += 1
            for N in (8192, 16384, 24576, 32768):
                base = a < N
                stats[f"id<{N}"] += base
                stats[f"id<{N}+ctx"] += base or a in seen
                stats[f"id<{N}+ctx+hist"] += base or a in seen or a in history
    print(d, n, {k: f"{v / n:.4f}" for k, v in sorted(stats.items())})
