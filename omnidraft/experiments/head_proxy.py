"""A fast proxy for draft policies: greedy speculative decoding simulated on held-out labels.

Under greedy verification a drafted token is accepted when it is the target's next token, and the
target's output does not depend on the drafter. So, teacher-forced on the held-out records, the
trained drafter's label at every emitted position (1: its greedy token is the target's) and the
acceptance head's P(accept) there are enough to replay decoding: from each step's start, draft
until the policy stops (or k), accept the leading run of 1s, emit one more token, go on. Time per
step is one target forward plus ``--draft-cost`` per drafted token (drafter step / verify pass,
measured on the machine the proxy stands for), so "speedup" = tokens / time against one forward
per token. How closely it predicted the README's real run is in NOTES.md.

    .venv/bin/python scripts/head_proxy.py --target builtin:qwen2.5-coder-0.5b --set alpaca \\
        --stream 0:200 --held-out 200:216 --records bench_out/records.pt --out bench_out/head-proxy

Trains one Distiller (TrainConfig fields as JSON via --config) along the stream, like
``online_proxy.py``, and writes head_proxy.json: for the untrained and the trained drafter, every
policy's simulated acceptance rate, tokens per target forward and speedup.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from omnidraft import models
from omnidraft.adapter.head import should_stop
from omnidraft.experiments.online import RecordCache, records_meta
from omnidraft.experiments.online_proxy import DRAFTER, examples, slice_ranges
from omnidraft.runtime import CacheOptions, load_pipeline
from omnidraft.train.config import TrainConfig
from omnidraft.train.distill import Distiller
from omnidraft.train.records import preimage_table

# stop(i, accept_probs_so_far) -> end the draft after the token at position i?
Policy = Callable[[int, list], bool]


def simulate(labels: list[float], stop: Policy, k: int, draft_cost: float) -> dict:
    """Greedy speculative decoding over one held-out sequence of acceptance labels."""
    n, s, steps, drafted, rates = len(labels), 0, 0, 0, []
    while s < n:
        d, probs = 0, []
        while True:
            i, d = s + d, d + 1
            if d >= k or i >= n - 1 or stop(i, probs):
                break
        a = 0
        while a < d and labels[s + a] > 0.5:
            a += 1
        steps, drafted = steps + 1, drafted + d
        rates.append(a / d)
        s += a + 1
    return {"acceptance": sum(rates) / len(rates), "tokens_per_forward": n / steps,
            "speedup": n / (steps + draft_cost * drafted)}


def policies(head_probs: list[float] | None, top_q: list[float], gammas, confidences) -> dict[str, tuple[Policy, int]]:
    """Named policies over one sequence: fixed k, the confidence stop, the head's eq. (7)."""
    out: dict[str, tuple[Policy, int]] = {f"fixed k={k}": (lambda i, ps: False, k) for k in (4, 6, 8)}
    for c in confidences:
        for k in (8, 12):
            out[f"confidence {c} k≤{k}"] = (lambda i, ps, c=c: top_q[i] < c, k)
    if head_probs is not None:
        for g in gammas:
            for k in (4, 8, 12):
                # the head scores each drafted token in turn: append its P(accept), then eq. (7)
                out[f"head γ={g} k≤{k}"] = (lambda i, ps, g=g: ps.append(head_probs[i]) or should_stop(ps, g), k)
    return out


def evaluate(distiller: Distiller, held: list, draft_cost: float, gammas, confidences) -> dict:
    """Every policy averaged over the held-out sequences (each weighs the same, as in the bench)."""
    sums: dict[str, dict] = {}
    for example in held:
        feats, labels = distiller.head_data([example])
        if not len(labels):
            continue
        with torch.no_grad():
            head = torch.sigmoid(distiller.accept_head(feats)).tolist() if distiller.accept_head is not None else None
        top_q = torch.sigmoid(feats[:, -2]).tolist()  # features hold logit(max q)
        for name, (stop, k) in policies(head, top_q, gammas, confidences).items():
            row = sums.setdefault(name, {"n": 0})
            for key, value in simulate(labels.tolist(), stop, k, draft_cost).items():
                row[key] = row.get(key, 0.0) + value
            row["n"] += 1
    return {name: {k: round(v / row["n"], 4) for k, v in row.items() if k != "n"} for name, row in sums.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--set", required=True)
    p.add_argument("--stream", nargs="+", required=True, help="LO:HI ranges of the set, streamed in order")
    p.add_argument("--held-out", nargs="+", required=True, help="LO:HI ranges, disjoint from the stream")
    p.add_argument("--records", type=Path, required=True)
    p.add_argument("--config", default='{"lr": 1e-3}', help="TrainConfig fields as JSON (+ interval)")
    p.add_argument("--draft-cost", type=float, default=0.21, help="one drafter step / one verify pass")
    p.add_argument("--gammas", default="0.5,0.7,0.8,0.9")
    p.add_argument("--confidences", default="0.4,0.6")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    gammas = [float(x) for x in args.gammas.split(",")]
    confidences = [float(x) for x in args.confidences.split(",")]
    config = json.loads(args.config)
    interval = config.pop("interval", 8)
    pipe = load_pipeline(args.target, DRAFTER, adapter="none", cache=CacheOptions(enabled=False), quiet=True)
    cache = RecordCache(args.records, records_meta(pipe, 128, 64))
    preimages, _ = preimage_table(pipe.decoder.bridge)
    stream = examples(pipe, slice_ranges(args.stream, args.set), cache, preimages)
    held = [e for e in examples(pipe, slice_ranges(args.held_out, args.set), cache, preimages) if e is not None]
    distiller = Distiller(models.load(DRAFTER, dtype="float32", progress=False)[0], pipe.decoder.bridge.dm_mask,
                          TrainConfig(**config))
    result = {"untrained": evaluate(distiller, held, args.draft_cost, gammas, confidences)}
    buffer: list = []
    for i, example in enumerate(stream, 1):
        if example is not None:
            buffer.append(example)
        if i % interval == 0 or i == len(stream):
            distiller.update(buffer)
            buffer = []
    result["trained"] = evaluate(distiller, held, args.draft_cost, gammas, confidences)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "head_proxy.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                          **result}, indent=1, ensure_ascii=False))
    for stage, rows in result.items():
        best = max(rows.items(), key=lambda kv: kv[1]["speedup"])
        print(f"{stage}: best {best[0]} (speedup {best[1]['speedup']:.2f}, acceptance {best[1]['acceptance']:.3f}); "
              f"fixed k=4 {rows['fixed k=4']['speedup']:.2f}")
    print(f"wrote {args.out / 'head_proxy.json'}")


if __name__ == "__main__":
    main()
