"""Trace the device's response to corrections: heard -> follow -> publishes (times in ms)."""
import json, sys, time
import omnidraft.rpc.streaming as st

LOG = []
_emitted, _follow, _publish, _draft = st.Device.emitted, st.Device._follow, st.Device._publish, st.Device._draft

def emitted(self, position, tokens, rest=False, rest_forks=False):
    LOG.append(("heard", time.monotonic(), position, len(tokens)))
    _emitted(self, position, tokens, rest, rest_forks)

def follow(self, position, tokens):
    t = time.monotonic(); r = _follow(self, position, tokens)
    LOG.append(("follow", t, position, bool(r)))
    return r

def publish(self):
    LOG.append(("pub", time.monotonic(), len(self.text), len(self.ahead)))
    _publish(self)

def draft(self):
    t = time.monotonic(); r = _draft(self)
    LOG.append(("draft", t, time.monotonic() - t, bool(r)))
    return r

st.Device.emitted, st.Device._follow, st.Device._publish, st.Device._draft = emitted, follow, publish, draft
from omnidraft.cli import main
try:
    main(sys.argv[2:])
finally:
    json.dump(LOG, open(sys.argv[1], "w"))
