"""Where a drafted token's time goes in the loop (native drafter, torch target)."""
import time, statistics, sys, collections
from omnidraft.bench.runner import fresh
from omnidraft.config import DecodeConfig
from omnidraft.data import load_prompts
from omnidraft.runtime import load_pipeline, encode_prompt
import omnidraft.drafter.drafter as DD

pipe = load_pipeline("builtin:qwen2.5-coder-0.5b", "builtin:smollm2-135m", engine="torch", adapter="none",
                     drafter_backend="native")
dec = pipe.decoder
lm = dec.drafter.lm
print(type(lm).__name__, lm.n_threads)
t = dec.target
recs = load_prompts("humaneval", n=int(sys.argv[1]) if len(sys.argv) > 1 else 4, offset=100)
prompts = [encode_prompt(t.tokenizer, r.text, chat=r.chat) for r in recs]
cfg = DecodeConfig(max_new_tokens=128)
feeds = collections.defaultdict(list)   # index within draft -> seconds of lm.step
orig_feed = lm._feed
state = {"i": 0, "last_verify_end": 0.0}
gap = []
def feed(ids):
    s = time.perf_counter(); r = orig_feed(ids); e = time.perf_counter() - s
    if len(ids) == 1:
        feeds[min(state["i"], 6)].append(e); state["i"] += 1
    else:
        feeds["read%d" % min(len(ids), 64)].append(e)
    return r
lm._feed = feed
orig_da = DD.Drafter.draft_after
da = []
def draft_after(self, window, k, policy, first=None):
    state["i"] = 0
    s = time.perf_counter(); r = orig_da(self, window, k, policy, first); e = time.perf_counter() - s
    da.append((e, len(r.tokens)))
    return r
DD.Drafter.draft_after = draft_after
for rep in range(2):
    for k in list(feeds): feeds[k].clear()
    da.clear()
    for p in prompts:
        fresh(dec); dec.generate(p, cfg)
    st = dec.stats
    print(f"rep {rep}: drafts {len(da)}, drafted tokens {sum(n for _, n in da)}, draft_after total {sum(e for e, _ in da):.2f}s"
          f" -> {1000*sum(e for e,_ in da)/max(1,sum(n for _,n in da)):.2f} ms/token; policy d {1000*dec.cost_policy.draft_cost.seconds_per_token:.2f} ms")
    for k in sorted(feeds, key=str):
        v = feeds[k]
        if v: print(f"   step idx {k}: n={len(v)} median {1000*statistics.median(v):.2f} ms mean {1000*statistics.mean(v):.2f}")
