"""Wrap SpeculativeDecoder.step to log each step: source, proposed, kept, verify_s, draft_s."""
import json, sys, time, os
from omnidraft import decode
from omnidraft.cli import main
LOG = open(os.environ.get("STEPLOG", "/tmp/prof/steps.jsonl"), "w")
orig = decode.SpeculativeDecoder.step
def step(self, ids, sources, policy, config, rows):
    t = time.perf_counter()
    r = orig(self, ids, sources, policy, config, rows)
    LOG.write(json.dumps({"n": len(ids), "src": r.source, "prop": len(r.proposal.proposed) if r.proposal else 0,
        "kept": r.accepted, "v": r.times.verify_s, "d": r.times.draft_s, "c": r.times.catch_up_s,
        "tr": r.times.translate_s, "wall": time.perf_counter() - t}) + "\n"); LOG.flush()
    return r
decode.SpeculativeDecoder.step = step
sys.exit(main(sys.argv[1:]))
