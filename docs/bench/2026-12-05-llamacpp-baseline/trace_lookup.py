"""The demo's llama.cpp Qwen prompts, fresh policy: every step that drafted (lookup or model), what it cost."""
import sys
from omnidraft.bench.runner import fresh
from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import encode_prompt, load_pipeline
pipe = load_pipeline("builtin:qwen2.5-coder-0.5b", "builtin:smollm2-135m", engine="llamacpp", quiet=True)
dec = pipe.decoder
orig = dec._account
def account(step, policy, reads_prompt):
    if step.source is not None:
        print(f"  {step.source} key={step.key} proposed={len(step.proposal.proposed)} kept={step.accepted} verify={step.times.verify_s*1000:.1f} ms")
    return orig(step, policy, reads_prompt)
dec._account = account
for text, chat in [("Write a Python function that checks whether a number is prime.", True), ("def quicksort(items):\n", False)]:
    for rep in range(3):
        fresh(dec)
        r = dec.generate(encode_prompt(pipe.target_tokenizer, text, chat=chat), DecodeConfig(max_new_tokens=96))
        print(text[:20], rep, f"{r.stats.tokens_per_s:.1f} tok/s steps {r.stats.steps}", dec.cost_policy.cost_table_ms(), flush=True)
print(dec.cost_policy.cost_table_ms())
