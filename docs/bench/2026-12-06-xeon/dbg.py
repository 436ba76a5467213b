"""Bench with a per-request dump of each mode's cost policy (the weights choice outlier)."""
import sys
import omnidraft.bench.runner as R
from omnidraft.cli import main

orig = R.run_bench

def dump(mode, fn):
    pol = getattr(getattr(fn, "decoder", None), "cost_policy", None)
    if pol is None or not pol.measured:
        return
    rates = " ".join(f"{r:.2f}" for r in pol.stats.rates(8))
    tried = " ".join(f"{t:.1f}" for t in pol.stats.tried[:8])
    cal = " ".join(f"{a:.1f}/{t:.1f}" for a, t in zip(pol.calibration.accepted, pol.calibration.tried))
    shelf = {k[-8:]: " ".join(f"{r:.2f}" for r in ev.stats.rates(6)) for k, ev in pol.shelf.items()}
    print(f"  [{mode}] w={str(pol.weights)[-8:]} d={pol.draft_cost.seconds_per_token*1000:.2f}ms req={pol._requests} "
          f"choices={dict(sorted(pol.choices.items()))} picks={pol.weights_choice.picks}\n"
          f"     rates {rates}\n     tried {tried}\n     cal {cal}\n     shelf {shelf}", flush=True)

def run_bench(mode_fns, prompts, warmup=None, progress=True):
    if warmup is not None:
        for m, fn in mode_fns.items():
            fn(warmup); dump(m, fn)
    runs = {m: [] for m in mode_fns}
    for p, mode in R.interleave(len(prompts), list(mode_fns)):
        r = mode_fns[mode](prompts[p]); runs[mode].append(r)
        print(f'prompt {p} {mode}: {len(r.token_ids)} tok, {r.target_forwards} fwd, wall {r.wall_s:.2f}', flush=True)
        dump(mode, mode_fns[mode])
    return runs

R.run_bench = run_bench
sys.exit(main(sys.argv[1:]))
