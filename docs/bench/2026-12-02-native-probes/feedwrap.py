"""Log every native drafter forward (rows, seconds, adapted or not) during a CLI run."""
import json, sys, time, os
from omnidraft.drafter import native_lm
from omnidraft.cli import main
LOG = open(os.environ.get("FEEDLOG", "/tmp/lora/feed.jsonl"), "w")
orig = native_lm.NativeDraftLM._feed
def feed(self, ids):
    t = time.perf_counter(); r = orig(self, ids)
    LOG.write(json.dumps({"rows": len(ids), "s": time.perf_counter() - t, "lora": self._adapter is not None, "ctx": len(self._ids)}) + "\n")
    return r
native_lm.NativeDraftLM._feed = feed
sys.exit(main(sys.argv[1:]))
