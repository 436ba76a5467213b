"""A/B in one bench run: the default cost-aware drafts against fixed drafts of 4 and 8 drafter tokens."""
import sys
from pathlib import Path
from dataclasses import replace
import omnidraft.bench.runner as R
from omnidraft.cli import main
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ab_identity import check_identity  # noqa: E402

orig = R.build_modes

def build_modes(pipe, modes, base, *a, **kw):
    fns = orig(pipe, modes, base, *a, **kw)
    for k in (4, 8):
        fns[f"greedy-fixed{k}"] = orig(pipe, ["greedy-adapter"], replace(base, draft_stop="fixed", draft_len=k), *a, **kw)["greedy-adapter"]
    return fns

R.build_modes = build_modes
check_identity()
sys.exit(main(sys.argv[1:]))
