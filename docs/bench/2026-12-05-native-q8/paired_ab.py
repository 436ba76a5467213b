"""Paired in-process A/B of the native drafter's one-token step: the GGUF's Q4_1 blocks against the same
weights re-quantized to Q8_0 (needs native-q8.patch applied). Alternating order, 8 rounds of 12 steps."""
import time, statistics, torch
from omnidraft import models
from omnidraft.drafter.native_lm import NativeDraftLM, load_native_model
gguf = models.gguf_of("builtin:smollm2-135m", None, progress=False)
lms = {"q41": NativeDraftLM(load_native_model(gguf, None)),
       "q8": NativeDraftLM(load_native_model(gguf, None, "Q8_0", None))}
tok = models.load_tokenizer("builtin:smollm2-135m", None, progress=False)
ids = tok.encode(open("/work/main/omnidraft/decode.py").read())[:200]
ref = lms["q41"].logits_for(ids)
for name, lm in lms.items():
    l = lm.logits_for(ids)
    print(name, "max|diff| vs q41", float((l - ref).abs().max()), "argmax same", int(l.argmax()) == int(ref.argmax()))
times = {n: [] for n in lms}
for rep in range(8):
    for name in (list(lms) if rep % 2 == 0 else list(lms)[::-1]):
        lm = lms[name]
        lm.logits_for(ids)
        t0 = time.perf_counter()
        for j in range(12):
            lm.step(ids[j])
        times[name].append((time.perf_counter() - t0) / 12 * 1e3)
for n, t in times.items():
    print(n, "ms/token median", round(statistics.median(t), 3), "min", round(min(t), 3))
