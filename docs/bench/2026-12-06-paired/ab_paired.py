"""A/B in one bench run: the weights choice by paired trials (the default where a switch is a swap:
the native drafter) and the same choice request by request (as before), beside the adapter always
and the base weights always."""
import sys
import omnidraft.bench.runner as R
from omnidraft.adapter.slot import AdapterSlot
from omnidraft.cli import main

orig = R.build_modes


class UnpairedSlot(AdapterSlot):
    alternates = False  # the choice compares whole requests, as before paired trials


def build_modes(pipe, modes, *a, **kw):
    fns = orig(pipe, modes, *a, **kw)
    fn = orig(pipe, ["greedy"], *a, **kw)["greedy"]
    fn.decoder.cost_policy.switch.__class__ = UnpairedSlot
    fns["greedy-unpaired"] = fn
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
