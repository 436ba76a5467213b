"""Serve with a log of each forward: which schedule chose, k, accepted, seconds, whether it explored, room, V(0), V(1)."""
import json, sys, time
import omnidraft.rpc.server as sv
OUT = open(sys.argv[1], "a")
_learn = sv.SessionBudget.learn
def learn(self, k, accepted, seconds, reads_prompt):
    c = self.budget._cost()
    v = [c(0), c(1)] if c else None
    OUT.write(json.dumps(("fwd", id(self) % 10000, time.monotonic(), k, accepted, round(seconds, 4), self.exploration.active,
                          round(self.exploration.room, 3), self.exploration.steps, v, self.acceptance.rate(1), reads_prompt)) + "\n"); OUT.flush()
    return _learn(self, k, accepted, seconds, reads_prompt)
sv.SessionBudget.learn = learn
from omnidraft.cli import main
main(sys.argv[2:])
