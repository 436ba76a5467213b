"""A/B in one bench run: the default policy with and without the deepening exploration."""
import sys
import omnidraft.bench.runner as R
from omnidraft.cli import main
from omnidraft.sources.policy import Exploration

orig = R.build_modes

def build_modes(pipe, modes, *a, **kw):
    fns = orig(pipe, modes, *a, **kw)
    off = orig(pipe, ["greedy"], *a, **kw)["greedy"]
    off.decoder.cost_policy.deepening = Exploration(share=0.0)  # never affords a deepening
    fns["greedy-nodeepen"] = off
    return fns

R.build_modes = build_modes
orig_report = R.policy_report
def policy_report(fns):
    out = orig_report(fns)
    for m, fn in fns.items():
        pol = getattr(getattr(fn, "decoder", None), "cost_policy", None)
        if pol is not None and m in out:
            out[m]["deepening"] = {"steps": pol.deepening.steps, "lost": round(pol.deepening.lost, 3), "every": pol.deepening.every}
    return out
R.policy_report = policy_report
sys.exit(main(sys.argv[1:]))
