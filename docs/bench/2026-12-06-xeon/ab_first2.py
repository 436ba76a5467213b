"""A/B in one bench run: the default policy (the first token from the target alone) and the same
policy drafting from the first step (as before)."""
import sys
import omnidraft.bench.runner as R
from omnidraft.cli import main

orig = R.build_modes

def build_modes(pipe, modes, *a, **kw):
    fns = orig(pipe, modes, *a, **kw)
    fn = orig(pipe, ["greedy"], *a, **kw)["greedy"]
    fn.decoder.cost_policy.may_draft_first = lambda offer, free: True  # drafts from the first step, as before
    fns["greedy-firstdraft"] = fn
    return fns

R.build_modes = build_modes
orig_sum = R.summarize
def summarize(runs, baseline="target", **kw):
    out = orig_sum(runs, baseline, **kw)
    if "target" in runs:
        for m in runs:
            same = [a.token_ids == b.token_ids for a, b in zip(runs[m], runs["target"])]
            out[m]["identical_to_target"] = all(same)
            out[m]["identical_prompts"] = sum(same)
    return out
R.summarize = summarize
sys.exit(main(sys.argv[1:]))
