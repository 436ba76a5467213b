"""A/B in one bench run: the first token waits for the drafter's read only up to a quarter of a plain step
(FIRST_READ_SHARE = 0.25, the default) against up to a whole plain step (as before), each arm with its own
drafter fork."""
import sys
from pathlib import Path
import omnidraft.bench.runner as R
import omnidraft.sources.policy as P
from omnidraft.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ab_identity import check_identity  # noqa: E402

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
check_identity()
sys.exit(main(sys.argv[1:]))
