"""A fast proxy for the online benchmark: training settings compared by held-out top-1 agreement.

`omnidraft bench --ablation online` decodes the held-out slice at every checkpoint (~10 s per
prompt and checkpoint on 2 cores). Under greedy verification, acceptance at a fixed draft length k
follows the drafter's per-token agreement a with the target's greedy token almost exactly:
accepted / proposed ≈ (a + a² + … + a^k) / k (README, "Does it learn?"). So settings can be
compared on a, measured teacher-forced on the held-out records at the DM positions (no decoding),
while each setting trains along the same stream in Algorithm 2's order.

    .venv/bin/python -m omnidraft.experiments.online_proxy --target builtin:qwen2.5-coder-0.5b --set alpaca \\
        --stream 0:200 216:340 --held-out 200:216 --records bench_out/records.pt \\
        --configs '[{"lr": 1e-3}, {"lr": 1e-3, "epochs": 3}]' --out bench_out/proxy

A range may name another set (``ja:0:100``), so one stream can visit several domains in turn, and
``--also SET:LO:HI …`` measures held-out slices of other domains at every evaluation: what a
later domain costs the ones learned before it (forgetting).

Each config is TrainConfig fields plus "interval" (prompts per update, default 8) and "replay"
(examples of earlier prompts re-trained at each update, default 0: not in the product, a probe). Records missing
from --records are decoded first (greedy, 128 new tokens, top-64) and saved there. Writes
proxy.json (per config: prompts streamed, held-out top-1 agreement at DM positions, and at every
emitted drafter position; the DM agreement before and after the stream split by the target's
confidence in its own greedy token, and the same on 16 stream prompts before and after training on
them, to tell fitting from generalising; the --also slices' agreement along the stream) and proxy.png (the DM agreement against prompts streamed).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from omnidraft import models
from omnidraft.config import DecodeConfig
from omnidraft.data import load_prompts
from omnidraft.experiments.online import RecordCache, record_prompts, records_meta
from omnidraft.runtime import CacheOptions, encode_prompt, load_pipeline
from omnidraft.train.config import TrainConfig
from omnidraft.train.distill import Distiller
from omnidraft.train.records import preimage_table, to_example

DRAFTER = "builtin:smollm2-135m"


def fixed_k_acceptance(a: float, k: int) -> float:
    """Expected accepted / proposed at draft length k when each token agrees with probability a."""
    return sum(a ** i for i in range(1, k + 1)) / k


def slice_ranges(specs: list[str], default_set: str) -> list[tuple[str, int, int]]:
    """``LO:HI`` (a slice of ``default_set``) or ``SET:LO:HI`` per spec, as (set, lo, hi)."""
    out = []
    for spec in specs:
        *name, lo_s, hi_s = spec.split(":")
        try:
            lo, hi = int(lo_s), int(hi_s)
        except ValueError:
            raise SystemExit(f"bad range {spec!r}: want [SET:]LO:HI") from None
        if not 0 <= lo < hi or len(name) > 1:
            raise SystemExit(f"bad range {spec!r}: want [SET:]LO:HI with 0 <= LO < HI")
        out.append((name[0] if name else default_set, lo, hi))
    return out


def examples(pipe, ranges: list[tuple[str, int, int]], cache: RecordCache, preimages) -> list:
    prompts = [encode_prompt(pipe.target_tokenizer, r.text, chat=r.chat)
               for name, lo, hi in ranges for r in load_prompts(name, n=hi - lo, offset=lo)]
    names = "+".join(dict.fromkeys(name for name, _, _ in ranges))
    records = record_prompts(pipe.decoder, prompts, DecodeConfig(max_new_tokens=128), cache, desc=f"record {names}")
    return [to_example(r, pipe.decoder.bridge, preimages) for r in records]


def agreement(distiller: Distiller, held: list) -> tuple[float, float]:
    """Held-out top-1 agreement at DM positions (argmax over the intersection, what L_DM trains)
    and at every emitted drafter position (argmax over the whole vocabulary, what greedy drafting
    with text translation proposes: straddling and n-gram tokens included)."""
    _, labels = distiller.head_data(held)
    return distiller.evaluate(held).top1_agreement, float(labels.mean())


CONFIDENCE_EDGES = (0.0, 0.5, 0.8, 0.95, 1.0001)  # the target's p of its own greedy token


def by_confidence(distiller: Distiller, held: list) -> list[dict]:
    """Held-out DM agreement split by the target's confidence in its greedy token: where the
    remaining disagreements sit (near-ties no drafter can call, or tokens the target is sure of)."""
    agree, logp = distiller.dm_agreement(held)
    p = logp.exp()
    rows = []
    for lo, hi in itertools.pairwise(CONFIDENCE_EDGES):
        inside = (p >= lo) & (p < hi)
        n = int(inside.sum())
        rows.append({"p_lo": lo, "p_hi": min(hi, 1.0), "share": n / max(len(p), 1),
                     "agreement": float(agree[inside].float().mean()) if n else float("nan"),
                     "share_of_misses": float((inside & ~agree).sum()) / max(int((~agree).sum()), 1)})
    return rows


def overall_agreement(rows: list[dict]) -> float:
    """The DM agreement over all buckets (``Distiller.evaluate``'s top-1), without another pass."""
    return sum(r["share"] * r["agreement"] for r in rows if r["share"])


def print_buckets(title: str, rows: list[dict]) -> None:
    print(f"  {title}: " + "; ".join(f"p∈[{r['p_lo']:.2f},{r['p_hi']:.2f}) {r['share']:.0%} of positions, "
                                    f"agreement {r['agreement']:.3f}, {r['share_of_misses']:.0%} of misses" for r in rows),
          flush=True)


def run_config(config: dict, stream: list, held: list, dm_mask: torch.Tensor, every: int,
               others: dict[str, list] | None = None
               ) -> tuple[list[tuple[int, float, float]], dict[str, list[dict]], dict[str, list[tuple[int, float]]]]:
    """Held-out (prompts streamed, DM agreement, all-position agreement) at 0 and every ``every``
    prompts, the agreement by target confidence before and after the stream, and the all-position
    agreement on each of ``others`` (held-out slices of other domains) at the same points: what
    adapting to later parts of the stream costs the domains the adapter learned earlier."""
    config = dict(config)
    interval = config.pop("interval", 8)
    replay = config.pop("replay", 0)  # also re-train on the last N stream examples at each update
    distiller = Distiller(models.load(DRAFTER, dtype="float32", progress=False)[0], dm_mask, TrainConfig(**config))
    curve = [(0, *agreement(distiller, held))]
    # Fitting or generalising? Agreement on 16 stream prompts, before and after training on them.
    seen_probe = [e for e in stream[:: max(1, len(stream) // 16)] if e is not None]
    others = others or {}
    kept = {name: [(0, agreement(distiller, held_other)[1])] for name, held_other in others.items()}
    buckets = {"before": by_confidence(distiller, held), "seen_before": by_confidence(distiller, seen_probe)}
    buffer: list = []
    seen: list = []
    for i, example in enumerate(stream, 1):
        if example is not None:
            buffer.append(example)
        if i % interval == 0 or i == len(stream):
            distiller.update(buffer + (seen[-replay:] if replay else []))
            seen += buffer
            buffer = []
        if i % every == 0 or i == len(stream):
            curve.append((i, *agreement(distiller, held)))
            print(f"  {config} after {i}: held-out top-1 {curve[-1][1]:.3f} (DM), {curve[-1][2]:.3f} (all)", flush=True)
            for name, held_other in others.items():
                kept[name].append((i, agreement(distiller, held_other)[1]))
                print(f"  {config} after {i}: {name} held-out top-1 (all) {kept[name][-1][1]:.3f}", flush=True)
    buckets |= {"after": by_confidence(distiller, held), "seen_after": by_confidence(distiller, seen_probe)}
    for name, points in kept.items():
        print(f"  {config}: {name} held-out top-1 (all) {points[0][1]:.3f} -> {points[-1][1]:.3f}", flush=True)
    for when, rows in buckets.items():
        print_buckets(f"{config} {when}", rows)
    print(f"  {config}: agreement on {len(seen_probe)} streamed (trained-on) prompts "
          f"{overall_agreement(buckets['seen_before']):.3f} -> {overall_agreement(buckets['seen_after']):.3f} (DM); "
          f"held-out {curve[0][1]:.3f} -> {curve[-1][1]:.3f}", flush=True)
    return curve, buckets, kept


def plot(path: Path, curves: dict[str, list], k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    base = next(iter(curves.values()))[0][1]
    lo, hi = 0.0, 1.0  # the agreement at which fixed-k acceptance is 1.5x the untrained one
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fixed_k_acceptance(mid, k) < 1.5 * fixed_k_acceptance(base, k) else (lo, mid)
    ax.axhline(lo, ls="--", color="grey")
    ax.text(2, lo - 0.008, f"needed for +50% acceptance at k={k} (a≈{lo:.2f})", color="grey")
    ax.set_xlabel("prompts streamed")
    ax.set_ylabel("held-out top-1 agreement at DM positions")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--set", required=True, help="prompt set (humaneval, alpaca, …)")
    p.add_argument("--stream", nargs="+", required=True,
                   help="[SET:]LO:HI ranges (of --set unless named), streamed in order")
    p.add_argument("--held-out", nargs="+", required=True, help="[SET:]LO:HI ranges, disjoint from the stream")
    p.add_argument("--also", nargs="*", default=[],
                   help="SET:LO:HI held-out slices of other domains, measured before and after each config")
    p.add_argument("--records", type=Path, required=True)
    p.add_argument("--configs", default='[{"lr": 1e-3}]', help="JSON list of TrainConfig fields (+ interval)")
    p.add_argument("--every", type=int, default=40, help="evaluate every N prompts")
    p.add_argument("--k", type=int, default=4, help="draft length for the +50%% line on the plot")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    stream_r, held_r = slice_ranges(args.stream, args.set), slice_ranges(args.held_out, args.set)
    also_r = slice_ranges(args.also, args.set)
    if any(s == h and a < d and c < b for s, a, b in stream_r for h, c, d in held_r + also_r):
        raise SystemExit("a held-out range overlaps the stream")
    pipe = load_pipeline(args.target, DRAFTER, adapter="none", cache=CacheOptions(enabled=False), quiet=True)
    cache = RecordCache(args.records, records_meta(pipe, 128, 64))
    preimages, _ = preimage_table(pipe.decoder.bridge)
    stream = examples(pipe, stream_r, cache, preimages)
    held = [e for e in examples(pipe, held_r, cache, preimages) if e is not None]
    others = {f"{s}:{a}:{b}": [e for e in examples(pipe, [(s, a, b)], cache, preimages) if e is not None]
              for s, a, b in also_r}
    runs = {json.dumps(c): run_config(c, stream, held, pipe.decoder.bridge.dm_mask, args.every, others)
            for c in json.loads(args.configs)}
    curves = {label: curve for label, (curve, _, _) in runs.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "proxy.json").write_text(json.dumps({"args": vars(args) | {"records": str(args.records), "out": str(args.out)},
                                                     "curves": curves,
                                                     "by_confidence": {label: b for label, (_, b, _) in runs.items()},
                                                     "other_domains": {label: o for label, (_, _, o) in runs.items()}},
                                                    indent=1))
    plot(args.out / "proxy.png", curves, args.k)
    print(f"wrote {args.out / 'proxy.json'}, {args.out / 'proxy.png'}")


if __name__ == "__main__":
    main()
