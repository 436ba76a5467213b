"""Classify rejected proposals: tokenization mismatch (the draft's text still agrees) vs disagreement."""
import sys, collections, json
from omnidraft.config import DecodeConfig
from omnidraft.runtime import encode_prompt, load_pipeline
from omnidraft.data import load_prompts

target = sys.argv[1] if len(sys.argv) > 1 else "builtin:qwen2.5-coder-0.5b"
pset = sys.argv[2] if len(sys.argv) > 2 else "humaneval"
n = int(sys.argv[3]) if len(sys.argv) > 3 else 4
pipe = load_pipeline(target, "builtin:smollm2-135m", engine="torch", quiet=True)
dec = pipe.decoder
bridge = dec.bridge
tb = bridge.t.token_bytes
counts = collections.Counter()
examples = []
verifier = dec.verifier
orig = verifier.verify
def verify(ids, proposal, config, rows):
    v = orig(ids, proposal, config, rows)
    if proposal is not None and proposal.draft is not None and proposal.proposed:
        P = proposal.proposed
        a = v.accepted
        counts["steps"] += 1
        counts["proposed"] += len(P)
        counts["accepted"] += a
        if a < len(P):
            rest = b"".join(tb[t] or b"" for t in P[a:])
            nxt = tb[v.next_token] or b""
            if nxt and rest.startswith(nxt) and v.next_token != P[a]:
                counts["tok_mismatch_text_agrees"] += 1
                # how many more proposed bytes agree? next token equals a prefix of the draft text
            elif nxt and nxt.startswith(rest):
                counts["draft_text_prefix_of_target"] += 1
            else:
                counts["disagree"] += 1
                if len(examples) < 60:
                    ctx = b"".join(tb[t] or b"" for t in list(ids[-8:]) + P[:a])
                    examples.append((ctx[-40:].decode("utf-8","replace"), rest.decode("utf-8","replace"), nxt.decode("utf-8","replace"), a))
                if a == len(P) - 1:
                    counts["disagree_at_last"] += 1
            # the drafted text vs the target token: is the last proposal a partial word?
        else:
            counts["all_accepted"] += 1
    return v
verifier.verify = verify
cfg = DecodeConfig(max_new_tokens=128, draft_stop="fixed", draft_len=8, lookup=False)
for rec in load_prompts(pset, n=n):
    ids = encode_prompt(pipe.target_tokenizer, rec.text, chat=rec.chat)
    r = dec.generate(ids, cfg)
    print(rec.id, r.stats.tokens_per_target_forward, r.stats.acceptance_rate, flush=True)
print(json.dumps(counts, indent=1))

for e in examples: print(repr(e))
