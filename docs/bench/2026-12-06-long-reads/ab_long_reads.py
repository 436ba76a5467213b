"""A/B in one bench run: the native drafter's long reads (float32 / AMX products from 16 / 32 rows, the
default) against every read on the integer products (as before), each arm with its own drafter fork."""
import sys
from pathlib import Path
import omnidraft.bench.runner as R
from omnidraft import kernels
from omnidraft.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ab_identity import check_identity  # noqa: E402

orig = R.build_modes
ext = kernels.qdraft()


class IntegerReads:
    """A mode whose requests run with long reads off."""

    def __init__(self, fn):
        self.fn = fn

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __call__(self, ids):
        before = ext.long_read_rows(0)
        try:
            return self.fn(ids)
        finally:
            ext.long_read_rows(before)


def build_modes(pipe, modes, *a, **kw):
    fns = orig(pipe, modes, *a, **kw)
    fns["greedy-intreads"] = IntegerReads(orig(pipe, ["greedy"], *a, **kw)["greedy"])
    return fns


R.build_modes = build_modes
check_identity()
sys.exit(main(sys.argv[1:]))
