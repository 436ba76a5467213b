"""What a batching server's forward costs on the GPU engine (``serve --batch``): one forward of S
sessions of a ``SessionPool``, every session doing a plain step or a verify of 4, in the classes the
pool's check allowed and with every forward the full class; a verify's rows either copied to the
host or, as a greedy server reads them, left on the GPU with only each session's argmax brought
over. Random Qwen2.5-shaped weights (a step's cost does not depend on their values), 512 tokens in
every session's cache. Also checks that session
0's logits are the same bits whoever else was in its forward. docs/remote.md reports it.

    python scripts/gpu_batch_probe.py --models qwen2.5-0.5b,qwen2.5-7b --sessions 1,2,4,8 --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch
from gpu_probe import CONFIGS, CONTEXT, _ms
from transformers import Qwen2Config, Qwen2ForCausalLM

from omnidraft.target import static


def probe(name: str, sessions: list[int], n: int, device: str, context: int) -> dict:
    """One pool of max(sessions) slots, warmed up (its classes checked); for each s, the first s
    sessions all step (or all verify 4) in one forward: with the checked classes, then with every
    forward the full class."""
    config = Qwen2Config(**CONFIGS[name], max_position_embeddings=32768, tie_word_embeddings=False)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    weights = static.extract(model, device, torch.bfloat16)
    del model
    ids = torch.randint(0, config.vocab_size, (CONTEXT + 64,), generator=torch.Generator().manual_seed(0)).tolist()
    pool = static.SessionPool(weights, max(sessions), context)
    pool.warm_up(16)
    checked = list(pool.classes)
    out: dict = {"model": name, "context": context, "pool": max(sessions), "classes": checked}
    lms = [pool.session() for _ in range(max(sessions))]
    for lm in lms:
        lm.logits_for(ids[:CONTEXT], 1)

    def step(active: list, k: int, greedy: bool = False):
        """One shared forward; ``greedy``: as a greedy server reads it (rows left on the device, each
        session's argmax taken there and its ids brought over), else every row copied to the host."""
        def run():
            for lm in active:
                lm.crop(CONTEXT)
            rows = static.logits_together([(lm, ids[:CONTEXT + 1 + k], k + 1) for lm in active], to_host=not greedy)
            if greedy:
                for r in rows:
                    r.argmax(-1).tolist()
        return run

    first: torch.Tensor | None = None  # session 0's verify of 4, to compare across classes
    for label, classes in (("", checked), ("full_", [max(sessions)])):
        pool.classes = classes
        for s in sessions:
            out[f"{label}S{s}_step_ms"] = round(_ms(step(lms[:s], 0), n), 3)
            out[f"{label}S{s}_verify4_ms"] = round(_ms(step(lms[:s], 4), n), 3)
            out[f"{label}S{s}_verify4_argmax_on_device_ms"] = round(_ms(step(lms[:s], 4, greedy=True), n), 3)
            lms[0].crop(CONTEXT)
            got = static.logits_together([(lm, ids[:CONTEXT + 5], 5) for lm in lms[:s]])[0]
            first = got if first is None else first
            out[f"{label}S{s}_same_bits"] = bool(torch.equal(got, first))
        print(json.dumps(out), flush=True)
    for rows in (5, 40):  # logit rows to the host as float32: a verify of 4, by one session and by eight
        block = torch.zeros(rows, config.vocab_size, device=device)
        out[f"to_host_{rows}_rows_ms"] = round(_ms(lambda: block.cpu(), n), 3)
    base = out[f"S{sessions[0]}_step_ms"]
    for s in sessions:
        out[f"S{s}_tokens_per_ms_vs_S{sessions[0]}"] = round(s / out[f"S{s}_step_ms"] / (sessions[0] / base), 2)
    del lms, pool
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b")
    parser.add_argument("--sessions", default="1,2,4,8")
    parser.add_argument("--context", type=int, default=static.DEFAULT_CONTEXT, help="positions of each session's cache")
    parser.add_argument("--n", type=int, default=50, help="timed calls per figure")
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(device_name, torch.__version__, flush=True)
    rows = [probe(name, [int(s) for s in args.sessions.split(",")], args.n, args.device, args.context)
            for name in args.models.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": device_name, "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
