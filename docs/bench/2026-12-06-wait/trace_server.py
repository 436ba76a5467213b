"""Serve with a log of the server's waits and each forward's (k, accepted, seconds)."""
import json, sys, time, atexit, signal
import omnidraft.rpc.server as sv
LOG = []
OUT = open(sys.argv[1], "a")
_wait, _learn = sv.Patience.wait, sv.SessionBudget.learn
def wait(self, drafts, ids, available, plan):
    want, worth = self.budget.worth_waiting(plan.acceptance, available)
    r = _wait(self, drafts, ids, available, plan)
    OUT.write(json.dumps(("wait", time.monotonic(), want, worth, r[2], len(r[0]), self.misses, self.lag_s, plan.acceptance.rate(1))) + "\n"); OUT.flush()
    return r
def learn(self, k, accepted, seconds, reads_prompt):
    OUT.write(json.dumps(("fwd", time.monotonic(), k, accepted, seconds)) + "\n"); OUT.flush()
    return _learn(self, k, accepted, seconds, reads_prompt)
sv.Patience.wait, sv.SessionBudget.learn = wait, learn
def dump(*a):
    json.dump(LOG, open(sys.argv[1], "w")); sys.exit(0)
signal.signal(signal.SIGTERM, dump)
from omnidraft.cli import main
main(sys.argv[2:])
