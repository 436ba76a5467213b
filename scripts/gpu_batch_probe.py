"""What a batching server's forward costs on the GPU engine (``serve --batch``): one forward of a
``SessionPool`` of S sessions, every session doing a plain step or a verify of 4, against one
session's plain step in a pool of one. Random Qwen2.5-shaped weights (a step's cost does not depend
on their values), 512 tokens in every session's cache. Also checks that a session's logits are the
same bits alone as together with the others. docs/remote.md reports it.

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
    config = Qwen2Config(**CONFIGS[name], max_position_embeddings=32768, tie_word_embeddings=False)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    weights = static.extract(model, device, torch.bfloat16)
    del model
    ids = torch.randint(0, config.vocab_size, (CONTEXT + 64,), generator=torch.Generator().manual_seed(0)).tolist()
    out: dict = {"model": name, "context": context}
    first: torch.Tensor | None = None  # the first class's logits of a verify of 4, to compare across classes
    for s in sessions:
        pool = static.SessionPool(weights, s, context)
        lms = [pool.session() for _ in range(s)]
        for lm in lms:
            lm.logits_for(ids[:CONTEXT], 1)
        pool.warm_up(16)

        def step(k: int):
            def run():
                for lm in lms:
                    lm.crop(CONTEXT)
                static.logits_together([(lm, ids[:CONTEXT + 1 + k], k + 1) for lm in lms])
            return run
        out[f"S{s}_step_ms"] = round(_ms(step(0), n), 3)
        out[f"S{s}_verify4_ms"] = round(_ms(step(4), n), 3)
        for lm in lms:
            lm.crop(CONTEXT)
        together = static.logits_together([(lm, ids[:CONTEXT + 5], 5) for lm in lms])
        lms[-1].crop(CONTEXT)
        alone = lms[-1].logits_for(ids[:CONTEXT + 5], 5)
        out[f"S{s}_alone_equals_together"] = bool(torch.equal(alone, together[-1]))
        first = alone if first is None else first
        out[f"S{s}_equals_S{sessions[0]}"] = bool(torch.equal(alone, first))  # the same rows in another class
        print(json.dumps(out), flush=True)
        del lms, pool
        if device == "cuda":
            torch.cuda.empty_cache()
    base = out[f"S{sessions[0]}_step_ms"]
    for s in sessions:
        out[f"S{s}_tokens_per_ms_vs_S{sessions[0]}"] = round(s / out[f"S{s}_step_ms"] / (sessions[0] / base), 2)
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
