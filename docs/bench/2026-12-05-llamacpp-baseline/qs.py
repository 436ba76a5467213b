"""The demo's quicksort row in-process: alone vs the demo's rerun twin, alternating, 8 runs each; lookups traced."""
import statistics, sys
sys.path.insert(0, "/work/main/demos")
import quickstart as q
from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import encode_prompt, load_pipeline
pipe = load_pipeline("builtin:qwen2.5-coder-0.5b", q.DRAFTER, engine="llamacpp", quiet=True)
alone = SpeculativeDecoder(pipe.decoder.target)
cfg = DecodeConfig(max_new_tokens=96)
alone.generate(encode_prompt(pipe.target_tokenizer, "Hello", chat=False), DecodeConfig(max_new_tokens=4))
for text, chat in [q.PRIME, q.QUICKSORT]:
    ids = encode_prompt(pipe.target_tokenizer, text, chat=chat)
    first = q._cold(pipe.decoder).generate(ids, cfg)
    again = q._rerun_decoder(pipe.decoder)
    a, s, lost = [], [], []
    for r in range(8):
        for arm in (("alone", "spec") if r % 2 else ("spec", "alone")):
            if arm == "alone":
                a.append(q._cold(alone).generate(ids, cfg).stats.tokens_per_s)
            else:
                res = q._cold(again).generate(ids, cfg); st = res.stats
                s.append(st.tokens_per_s); lost.append((st.lookup_steps, st.steps - st.plain_steps - st.lookup_steps))
    print(text[:24], f"alone {statistics.median(a):.1f} spec {statistics.median(s):.1f} ratio {statistics.median(s)/statistics.median(a):.3f}",
          "per-run ratios", [round(x / y, 3) for x, y in zip(s, a)], "lookups/drafts", lost[:4], flush=True)
