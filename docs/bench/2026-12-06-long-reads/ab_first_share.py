"""A/B in one bench run: the first token waits for the drafter's read only up to a quarter of a plain step
(FIRST_READ_SHARE = 0.25, the default) against up to a whole plain step (as before), each arm with its own
drafter fork."""
import sys
import omnidraft.bench.runner as R
import omnidraft.sources.policy as P
from omnidraft.cli import main

orig = R.build_modes


class WholeStep(P.CostPolicy):
    def may_draft_first(self, offer, free):
        if free or not self.measured or not self.read_cost.known:
            return True
        return offer.unread * self.read_cost.seconds_per_token <= self._capped_verify()(0)


def build_modes(pipe, modes, *a, **kw):
    fns = orig(pipe, modes, *a, **kw)
    fn = orig(pipe, ["greedy"], *a, **kw)["greedy"]
    fn.decoder.cost_policy.__class__ = WholeStep
    fns["greedy-wholestep"] = fn
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
