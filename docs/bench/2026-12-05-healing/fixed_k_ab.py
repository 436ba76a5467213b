"""The prototype that measured token healing before it was built: it patches Drafter.draft (healing the
context's last token by hand) on the tree before the change. On the tree after it, healing is built in and
this script's "plain" mode heals too; compare with the bench's greedy-noheal mode instead.
Usage: fixed_k_ab.py TARGET SET N plain|heal|healws [K]: tokens per target forward at a fixed draft length,
lookup off ("heal": any last token that longer ones extend; "healws": whitespace tokens only)."""
import sys, bisect, json, time
import torch
from omnidraft.config import DecodeConfig
from omnidraft.runtime import encode_prompt, load_pipeline
from omnidraft.data import load_prompts
from omnidraft.drafter.drafter import Drafter
from omnidraft.drafter.base import Draft

target = sys.argv[1]; pset = sys.argv[2]; n = int(sys.argv[3]); mode = sys.argv[4]
k = int(sys.argv[5]) if len(sys.argv) > 5 else 8
pipe = load_pipeline(target, "builtin:smollm2-135m", engine="torch", quiet=True)
dec = pipe.decoder; bridge = dec.bridge
db = bridge.d.token_bytes
entries = sorted((b, i) for i, b in enumerate(db) if b)
keys = [e[0] for e in entries]
def ext_ids(b):
    lo = bisect.bisect_left(keys, b)
    out = []
    j = lo
    while j < len(keys) and keys[j].startswith(b):
        out.append(entries[j][1]); j += 1
    return out
healed = [0, 0]
orig = Drafter.draft
def draft(self, context, k, policy):
    b = db[context[-1]] if context else None
    if mode.startswith("heal") and b and (mode == "heal" or not b.strip()):
        ids = ext_ids(b)
        if len(ids) > 1:
            window = self._window(context[:-1], k)
            logits = self.lm.logits_for(window)
            mask = torch.full_like(logits, float("-inf")); mask[ids] = 0
            t1 = int((logits + policy.constraint.bias()[:len(logits)] + mask).argmax())
            healed[0] += 1
            if t1 == context[-1]:
                return orig(self, context, k, policy)
            healed[1] += 1
            rest = db[t1][len(b):]
            rest_ids = bridge.drafter_encode(rest)
            sub = self.draft_after(list(window) + [t1], max(k - len(rest_ids), 1), policy)
            return Draft(rest_ids + sub.tokens, None, context, k, sub.read_s, sub.read_tokens, [-1] * (len(rest_ids) + len(sub.tokens)))
    return orig(self, context, k, policy)
Drafter.draft = draft
cfg = DecodeConfig(max_new_tokens=128, draft_stop="fixed", draft_len=k, lookup=False, branch_rows=0)
tot = [0, 0, 0]
for rec in load_prompts(pset, n=n):
    ids = encode_prompt(pipe.target_tokenizer, rec.text, chat=rec.chat)
    r = dec.generate(ids, cfg)
    tot[0] += r.stats.new_tokens; tot[1] += r.stats.target_forwards; tot[2] += r.stats.accepted_tokens
    print(rec.id, round(r.stats.tokens_per_target_forward, 2), flush=True)
print(mode, "tokens/forward", tot[0] / tot[1], "accepted", tot[2], "healed", healed)
