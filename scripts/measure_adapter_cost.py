"""Usage: OMNIDRAFT_HOME=... .venv/bin/python scripts/measure_adapter_cost.py

ms/token of the drafter with and without an adapter: int8 ONNX (LoRA inputs vs merged) and GGUF (base vs GGUF LoRA)."""
import copy, statistics, time, tempfile, sys
from pathlib import Path
import numpy as np, torch
from omnidraft import models
from omnidraft.adapter import store
from omnidraft.train import lora
from omnidraft.train.publish import save
from omnidraft.export.onnx_export import export_drafter, export_adapter
from omnidraft.drafter.onnx_lm import OnnxDraftLM
from omnidraft.runtime import gguf_drafter
import os
home = os.environ.get("OMNIDRAFT_HOME"); spec = "builtin:smollm2-135m"
model, tok = models.load(spec, home=home, progress=False)
peft = lora.attach(copy.deepcopy(model), lora.lora_config(rank=32, alpha=32))
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for n,p in peft.named_parameters():
        if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=g)*0.002)
root = Path(tempfile.mkdtemp())
save(root/"pair", peft, {"identity": {"drafter_arch": store.architecture_fingerprint(model)}, "updates": 1})
loaded = store.load(root/"pair", None)
plain = export_drafter(model, tok, root/"int8", quant="int8", spec=spec)
merged = export_drafter(model, tok, root/"int8-merged", quant="int8", spec=spec, merged=loaded)
text = ("def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n" * 8)
ids = tok(text)["input_ids"][:200]
def ms(lm, n=60):
    lm.reset(); lm.logits_for(ids); t=[]
    for i in range(n):
        s=time.perf_counter(); lm.step(ids[i % len(ids)]); t.append(time.perf_counter()-s)
    return 1000*statistics.median(t)
rows = {}
for rep in range(3):
    a = OnnxDraftLM(plain); rows.setdefault("onnx int8, no adapter", []).append(ms(a))
    a.apply_adapter(loaded.state, loaded.scaling); rows.setdefault("onnx int8, adapter as LoRA inputs", []).append(ms(a))
    b = OnnxDraftLM(merged); rows.setdefault("onnx int8, adapter merged", []).append(ms(b))
    c,_ = gguf_drafter(spec, home, True); rows.setdefault("gguf, no adapter", []).append(ms(c))
    c.apply_adapter(loaded.state, loaded.scaling); rows.setdefault("gguf, GGUF LoRA", []).append(ms(c))
    c.engine.close()
for k,v in rows.items(): print(f"| {k} | {statistics.median(v):.1f} | {' / '.join(f'{x:.1f}' for x in v)} |")
