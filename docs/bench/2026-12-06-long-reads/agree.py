"""Top-1 agreement of drafter steps after a prompt read three ways: integer products (the reference), float32
long reads, AMX long reads (three bfloat16 products). Real prompts: HumanEval, AlpacaEval, zh 100-115; 24 greedy
steps after each read, teacher-forced on the reference's tokens, every step on the integer products."""
import os
from pathlib import Path
import torch
from omnidraft import kernels, models
from omnidraft.data import load_prompts
from omnidraft.drafter.native_lm import NativeDraftLM, load_native_model
ext = kernels.qdraft()
home = Path(os.environ["OMNIDRAFT_HOME"])
lm = NativeDraftLM(load_native_model(models.gguf_of("builtin:smollm2-135m", home, progress=False)))
tok = models.load_tokenizer("builtin:smollm2-135m", home, progress=False)
for name in ("humaneval", "alpaca", "zh"):
    prompts = load_prompts(name, n=16, offset=100, home=home)
    agree = {"f32": [0, 0], "amx": [0, 0]}; maxd = {"f32": 0.0, "amx": 0.0}
    for p in prompts:
        ids = tok.encode(p.text)[:1024]
        # reference: int read, then greedy steps
        ext.long_read_rows(0)
        lm.reset(); ref = [lm.logits_for(ids).clone()]; toks = [int(ref[0].argmax())]
        for _ in range(24):
            ref.append(lm.step(toks[-1]).clone()); toks.append(int(ref[-1].argmax()))
        for mode in ("f32", "amx"):
            ext.long_read_rows(16); assert ext.use_amx(mode == "amx") == (mode == "amx")
            lm.reset(); got = [lm.logits_for(ids).clone()]
            ext.long_read_rows(0)
            for t in toks[:-1]:
                got.append(lm.step(t).clone())
            for a, b in zip(ref, got):
                agree[mode][0] += int(a.argmax()) == int(b.argmax()); agree[mode][1] += 1
                maxd[mode] = max(maxd[mode], float((a - b).abs().max()))
    print(name, {m: f"{a}/{n} = {a/n:.4f}" for m, (a, n) in agree.items()}, {m: f"{d:.3f}" for m, d in maxd.items()})
ext.long_read_rows(16); ext.use_amx(True)
