import time
from omnidraft.bench.runner import fresh
from omnidraft.config import DecodeConfig
from omnidraft.data import load_prompts
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import load_pipeline, encode_prompt
pipe = load_pipeline("builtin:qwen2.5-coder-0.5b", "builtin:smollm2-135m", engine="torch", adapter="none", drafter_backend="native", quiet=True)
dec = pipe.decoder
t = dec.target
recs = load_prompts("alpaca", n=3, offset=101)
cfg = DecodeConfig(max_new_tokens=128)
alone = SpeculativeDecoder(t)
for r in recs:
    p = encode_prompt(t.tokenizer, r.text, chat=r.chat)
    fresh(alone); s = time.perf_counter(); a = alone.generate(p, cfg); ta = time.perf_counter() - s
    fresh(dec); s = time.perf_counter(); b = dec.generate(p, cfg); tb = time.perf_counter() - s
    print(r.id, len(p), "alone", len(a.token_ids), f"{ta:.2f}s", "spec", len(b.token_ids), f"{tb:.2f}s", "identical", a.token_ids == b.token_ids,
          "steps", b.stats.steps, "drafted", b.stats.drafted_tokens, "lookup", b.stats.lookup_steps, flush=True)
