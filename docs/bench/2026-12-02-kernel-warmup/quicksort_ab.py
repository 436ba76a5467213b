"""The demo's quicksort prompt on llama.cpp: target alone vs our loop (no drafting happens), many interleaved runs,
with per-step verify time and wall time for each arm."""
import sys, time, statistics, copy
sys.path.insert(0, "/tmp/democlone/demos")
from quickstart import QUICKSORT, PRIME, DRAFTER, _cold, _rerun_decoder
from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import encode_prompt, load_pipeline
pipe = load_pipeline("builtin:qwen2.5-coder-0.5b", DRAFTER, engine="llamacpp", quiet=True)
alone = SpeculativeDecoder(pipe.decoder.target)
cfg = DecodeConfig(max_new_tokens=96)
ids = encode_prompt(pipe.target_tokenizer, *QUICKSORT) if False else encode_prompt(pipe.target_tokenizer, QUICKSORT[0], chat=QUICKSORT[1])
alone.generate(encode_prompt(pipe.target_tokenizer, "Hello", chat=False), DecodeConfig(max_new_tokens=4))
pipe.decoder.generate(encode_prompt(pipe.target_tokenizer, PRIME[0], chat=True), cfg)  # as the demo: prime first
twin = _rerun_decoder(pipe.decoder)
rows = {"alone": [], "ours": []}
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 8):
    for name, dec in (("alone", alone), ("ours", twin)):
        r = _cold(dec).generate(ids, cfg); s = r.stats
        rows[name].append((s.tokens_per_s, s.verify_s, s.wall_s, s.steps, s.plain_steps))
for name, v in rows.items():
    print(name, "tok/s", ["%.1f" % x[0] for x in v], "median %.1f" % statistics.median(x[0] for x in v))
    print("   verify s", ["%.2f" % x[1] for x in v], "wall-verify ms/step", ["%.2f" % ((x[2]-x[1])/x[3]*1e3) for x in v], "steps", [x[3] for x in v])
