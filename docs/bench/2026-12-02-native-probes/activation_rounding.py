"""Top-1 agreement of the fp32 SmolLM2 drafter with its Linear inputs rounded per block of 32 as the native
forward does (int16 as lo/hi bytes: |q| <= 32512) and as 8-bit activations would (|q| <= 127), against the
fp32 drafter itself, teacher-forced over every position of text chunks (code and prose from this repo)."""
import glob, sys, torch  # run from the repository root: python docs/bench/2026-12-02-native-probes/activation_rounding.py
from omnidraft import models
model, tok = models.load("builtin:smollm2-135m", progress=False)

model.eval()
files = sorted(glob.glob('/work/main/omnidraft/**/*.py', recursive=True))[:40:4] + sorted(glob.glob('/work/main/docs/*.md'))[:10]
chunks = []
for f in files:
    ids = tok(open(f, encoding='utf-8').read())['input_ids']
    chunks += [ids[i:i + 256] for i in range(0, min(len(ids), 1024) - 255, 256)]
print(len(chunks), 'chunks of 256 tokens from', len(files), 'files')
QMAX = None
INT8 = ()  # module-name parts whose inputs take 8-bit activations; the rest take the native int16
def fake(x, q):
    shape = x.shape
    b = x.reshape(-1, 32)
    amax = b.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / q, torch.ones_like(amax))
    return (torch.round(b / scale) * scale).reshape(shape)
hooks = []
for name, mod in model.named_modules():
    if isinstance(mod, torch.nn.Linear):
        hooks.append(mod.register_forward_pre_hook(
            lambda m, args, name=name: (fake(args[0], 127.0 if any(p in name for p in INT8) else 32512.0),) if QMAX else None))
def tops():
    out = []
    with torch.inference_mode():
        for c in chunks:
            out.append(model(torch.tensor([c])).logits[0].argmax(-1))
    return torch.cat(out)
ref = tops()
QMAX = True
for parts in [(), ("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"), ("o_proj",), ("down_proj",), ("lm_head",),
              ("gate_proj", "up_proj", "q_proj", "k_proj", "v_proj")]:
    INT8 = parts
    got = tops()
    print(f"8-bit activations into {parts or 'none'} (int16 elsewhere): top-1 agreement {float((got == ref).float().mean()):.4f} over {ref.numel()} positions", flush=True)
