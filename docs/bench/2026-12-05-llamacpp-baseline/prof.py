"""Per-step cost outside llama.cpp's eval: target alone vs the default policy (drafter + lookup)."""
import cProfile, pstats, sys, time
from omnidraft.bench.runner import fresh
from omnidraft.config import DecodeConfig
from omnidraft.data import load_prompts
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import load_pipeline, encode_prompt

pipe = load_pipeline("builtin:qwen2.5-coder-0.5b", "builtin:smollm2-135m", engine="llamacpp")
t = pipe.decoder.target
recs = load_prompts("humaneval", n=4)
prompts = [encode_prompt(t.tokenizer, r.text, chat=r.chat) for r in recs]
alone = SpeculativeDecoder(t)
spec = SpeculativeDecoder(t, pipe.decoder.drafter, pipe.decoder.bridge)  # no lookup history: the bench modes
cfg = DecodeConfig(max_new_tokens=128)
ev = [0.0]
orig = t._eval
def timed(*a, **k):
    s = time.perf_counter(); r = orig(*a, **k); ev[0] += time.perf_counter() - s; return r
t._eval = timed
def run(dec, label):
    tot = steps = evs = 0.0
    for p in prompts:
        fresh(dec); ev[0] = 0.0; s = time.perf_counter()
        r = dec.generate(p, cfg); w = time.perf_counter() - s
        tot += w - ev[0]; steps += dec.stats.steps
        st = dec.stats
        print(f"   {label} prompt outside {1000*(w-ev[0]):.0f} ms, steps {st.steps}, draft {st.draft_s*1000:.0f} catch {st.catch_up_s*1000:.0f} bridge {st.bridge_s*1000:.0f} other {st.other_s*1000:.0f} measure {st.measure_s*1000:.0f} wall_s {st.wall_s*1000:.0f} vs {w*1000:.0f}", flush=True)
    print(f"{label}: outside eval {1000*tot/steps:.3f} ms/step over {int(steps)} steps", flush=True)
for rep in range(3):
    run(alone, "alone"); run(spec, "policy")
if len(sys.argv) > 1:
    pr = cProfile.Profile(); pr.enable(); run(spec, "policy (profiled)"); pr.disable()
    st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(25)
