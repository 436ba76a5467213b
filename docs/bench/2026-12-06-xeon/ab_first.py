"""A/B in one bench run: the default policy, and the same with the first token from the target alone
(no model draft on the step that reads the prompt; free lookups still offered)."""
import sys, types
import omnidraft.bench.runner as R
from omnidraft.cli import main

orig = R.build_modes

def build_modes(pipe, modes, *a, **kw):
    fns = orig(pipe, modes, *a, **kw)
    first = orig(pipe, ["greedy"], *a, **kw)["greedy"]
    dec = first.decoder
    plain_offers = dec._offers
    def offers(self, ids, sources, room):
        out = plain_offers(ids, sources, room)
        return [(s, o) for s, o in out if s.free] if self.stats.steps == 0 else out
    dec._offers = types.MethodType(offers, dec)
    fns["greedy-firstplain"] = first
    return fns

R.build_modes = build_modes
sys.exit(main(sys.argv[1:]))
