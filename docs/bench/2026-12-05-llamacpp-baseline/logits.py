import numpy as np, llama_cpp
from omnidraft.bench.runner import llama_native_mode
from omnidraft.data import load_prompts
from omnidraft.config import DecodeConfig
from omnidraft.runtime import load_pipeline
from omnidraft.bench.conversations import expand_turns
pipe = load_pipeline("builtin:qwen2.5-coder-0.5b", None, engine="llamacpp", quiet=True)
t = pipe.decoder.target
prompts, _ = expand_turns(t, load_prompts("humaneval", n=4), DecodeConfig(max_new_tokens=64))
p = prompts[2]
native = llama_native_mode(t, 64)
llm = native.__closure__  # not needed
import gc
llms = [o for o in gc.get_objects() if isinstance(o, llama_cpp.Llama)]
llm = llms[-1]
V = t.vocab_size
llm.reset(); nat, nlog = [], []
for tok in llm.generate(p, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
    nlog.append(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(V,)).copy()); nat.append(int(tok))
    if len(nat) == 50: break
t.reset(); ids = list(p); ours, olog = [], []
for j in range(50):
    row = t.score(ids, 0)[0].numpy()
    olog.append(row); tok = int(row.argmax()); ours.append(tok); ids.append(tok)
for j in range(50):
    d = np.abs(nlog[j] - olog[j]).max()
    if d > 0 or nat[j] != ours[j]:
        print(j, "maxdiff", d, "nat", nat[j], "ours", ours[j], "nat argmax", nlog[j].argmax(), "top2 nat", np.sort(nlog[j])[-2:], "top2 ours", np.sort(olog[j])[-2:])
        if nat[j] != ours[j]: break
print("done")
