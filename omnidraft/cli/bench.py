"""``omnidraft bench``: speed and acceptance of every mode, side by side in one run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omnidraft.config import DEFAULT_DRAFTER_DTYPE, DecodeConfig
from omnidraft.errors import OmnidraftError

DEFAULT_MODES = "target,hf-target,hf-uag,greedy,greedy-ngram,greedy-nocache,tli,omnidraft"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark our modes against the target alone and transformers' assisted generation")
    p.add_argument("--drafter", default="builtin:smollm2-135m")
    p.add_argument("--target", default="builtin:qwen2.5-coder-0.5b")
    p.add_argument("--prompts", default="humaneval", help="humaneval | alpaca | xsum | asdiv | path/to/file.jsonl")
    p.add_argument("--n", type=int, default=10, help="number of prompts")
    p.add_argument("--offset", type=int, default=0, help="skip this many prompts of the set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated (default {DEFAULT_MODES})")
    p.add_argument("--draft-len", type=int, default=DecodeConfig.draft_len)
    p.add_argument("--draft-confidence", type=float, default=DecodeConfig.draft_confidence)
    p.add_argument("--temperature", type=float, default=0.7, help="for the sampling modes tli and omnidraft")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter-dtype", default=DEFAULT_DRAFTER_DTYPE, choices=("float32", "bfloat16", "int8"),
                   help="drafter precision (the target stays float32; hf-uag uses the same drafter)")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.set_defaults(func=run)


def _validate(args: argparse.Namespace) -> list[str]:
    from omnidraft.bench.runner import ALL_MODES

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown or not modes:
        raise OmnidraftError(f"unknown --modes {unknown or '(empty)'}; choose from {', '.join(ALL_MODES)}")
    if args.n < 1 or args.max_new_tokens < 2 or args.draft_len < 1 or args.offset < 0:
        raise OmnidraftError("--n and --draft-len must be >= 1, --max-new-tokens >= 2, --offset >= 0")
    return modes


def run(args: argparse.Namespace) -> int:
    import torch

    from omnidraft.bench.report import markdown_table, write_results
    from omnidraft.bench.runner import build_modes, run_bench, summarize
    from omnidraft.data import load_prompts
    from omnidraft.runtime import encode_prompt, load_pipeline

    modes = _validate(args)
    records = load_prompts(args.prompts, n=args.n, offset=args.offset)
    if not records:
        raise OmnidraftError(f"--prompts {args.prompts} has no prompts at offset {args.offset}")
    pipe = load_pipeline(args.target, args.drafter, drafter_dtype=args.drafter_dtype)
    prompts = [encode_prompt(pipe.target_tokenizer, r.text, chat=r.chat) for r in records]
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, draft_len=args.draft_len, seed=args.seed,
                        draft_confidence=args.draft_confidence)
    base.validate()
    fns = build_modes(pipe, modes, base, args.temperature)
    warm = encode_prompt(pipe.target_tokenizer, "Hello, world. Write one short sentence.", chat=False)
    runs = run_bench(fns, prompts, warmup=warm[:16])
    summary = summarize(runs)
    meta = {"drafter": args.drafter, "target": args.target, "prompts": args.prompts, "n": len(prompts),
            "offset": args.offset, "max_new_tokens": args.max_new_tokens, "draft_len": args.draft_len,
            "draft_confidence": args.draft_confidence,
            "drafter_dtype": args.drafter_dtype, "temperature_sampling_modes": args.temperature,
            "threads": torch.get_num_threads()}
    files = write_results(args.out, meta, summary)
    sys.stdout.write(markdown_table(summary))
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0
