"""A/B in one bench run: the native drafter's pruned head (the kept rows: the first third of the ids and every
token the home has read, the default) against the whole head, each arm with its own drafter fork."""
import sys
from pathlib import Path
import omnidraft.bench.runner as R
from omnidraft import runtime
from omnidraft.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ab_identity import check_identity  # noqa: E402

orig = R.build_modes


class WholeHead:
    """A mode whose requests step on the whole head (no kept set: nothing is added to it either)."""

    def __init__(self, fn):
        self.fn = fn

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __call__(self, ids):
        (weights,) = runtime._NATIVE_WEIGHTS.values()
        vocab = weights.head_vocab
        object.__setattr__(weights, "head_vocab", None)
        try:
            return self.fn(ids)
        finally:
            object.__setattr__(weights, "head_vocab", vocab)


def build_modes(pipe, modes, *a, **kw):
    fns = orig(pipe, modes, *a, **kw)
    fns["greedy-wholehead"] = WholeHead(orig(pipe, ["greedy"], *a, **kw)["greedy"])
    return fns


R.build_modes = build_modes
check_identity()
sys.exit(main(sys.argv[1:]))
