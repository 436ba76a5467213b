"""Bench with a count of the device's messages heard (rest or not, verify_k) and its drafting seconds."""
import json, sys, time, atexit, collections
import omnidraft.rpc.streaming as st
C = collections.Counter(); T = collections.Counter()
_hear, _draft, _read = st.Device._hear, st.Device._draft, st.Device._loop
def hear(self, position, tokens, rest, rest_forks, verify_k):
    C[f"rest={rest}"] += 1; C[f"k={verify_k}"] += 1
    return _hear(self, position, tokens, rest, rest_forks, verify_k)
def draft(self):
    t = time.perf_counter(); r = _draft(self); T["draft_s"] += time.perf_counter() - t; C["chunks"] += 1
    return r
st.Device._hear, st.Device._draft = hear, draft
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps({"counts": C, "times": T}, indent=1)))
from omnidraft.cli import main
main(sys.argv[2:])
