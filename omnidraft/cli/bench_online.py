"""``omnidraft bench --ablation online``: the online distillation benchmark (issue 5), glue only.

The stream is ``--stream-n`` prompts of ``--prompts`` from ``--offset``; the held-out slice is the
``--n`` prompts right after it. With ``--shift-to SET`` the stream's second half comes from SET and
both sets get a held-out slice (the distribution-shift run). See ``omnidraft/bench/online.py``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from omnidraft.errors import OmnidraftError

DEFAULT_STREAM_N = 200
DEFAULT_CHECKPOINTS = 4


def add_online_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--checkpoints", type=int, default=DEFAULT_CHECKPOINTS,
                       help=f"(--ablation online) evaluations along the stream after the untrained one (default {DEFAULT_CHECKPOINTS})")
    group.add_argument("--losses", default="dm,hybrid", help="(--ablation online) losses to compare: dm, hybrid, frozen (no distillation: the acceptance head alone)")
    group.add_argument("--head-draft-len", type=int, default=None,
                       help="(--ablation online) most tokens per draft when the acceptance head (or the confidence "
                            "baseline it replaces) stops drafts (default: --draft-len)")
    group.add_argument("--shift-to", default=None, help="(--ablation online) the stream's second half comes from this set")
    group.add_argument("--records", type=Path, default=None,
                       help="(--ablation online) cache of recorded target outputs, reused across runs (default OUT/records.pt)")


def _slices(args: argparse.Namespace, stream_n: int):
    """(stream records, their set names, held-out records by set) as PromptRecords."""
    from omnidraft.data import load_prompts

    if args.shift_to is None:
        stream = load_prompts(args.prompts, n=stream_n, offset=args.offset)
        held = {args.prompts: load_prompts(args.prompts, n=args.n, offset=args.offset + stream_n)}
        sets = [args.prompts] * len(stream)
    else:
        half = stream_n // 2
        first = load_prompts(args.prompts, n=half, offset=args.offset)
        second = load_prompts(args.shift_to, n=stream_n - half, offset=0)
        stream, sets = first + second, [args.prompts] * len(first) + [args.shift_to] * len(second)
        held = {args.prompts: load_prompts(args.prompts, n=args.n, offset=args.offset + half),
                args.shift_to: load_prompts(args.shift_to, n=args.n, offset=stream_n - half)}
    if len(stream) < stream_n or any(len(v) < args.n for v in held.values()):
        raise OmnidraftError(f"not enough prompts for a stream of {stream_n} and {args.n} held-out "
                             f"(sets: {', '.join(held)}); lower --stream-n / --n or --offset")
    return stream, sets, held


def run_online_ablation(args: argparse.Namespace, stream_n: int) -> int:
    import torch

    from omnidraft.bench.online import (
        LOSSES,
        OnlinePlan,
        RecordCache,
        checkpoints_for,
        modes_of,
        records_meta,
        run_online,
        write_online,
    )
    from omnidraft.cli.adapt import train_config
    from omnidraft.cli.generate import draft_stop_options
    from omnidraft.config import DecodeConfig
    from omnidraft.runtime import CacheOptions, encode_prompt, load_pipeline

    losses = [x.strip() for x in args.losses.split(",") if x.strip()]
    if not losses or any(x not in LOSSES for x in losses):
        raise OmnidraftError(f"--losses takes a comma-separated list of {', '.join(LOSSES)}")
    if args.checkpoints < 1 or args.checkpoints > stream_n:
        raise OmnidraftError("--checkpoints must be between 1 and --stream-n")
    if args.drafter == "none" or args.drafter_dtype == "int8":
        raise OmnidraftError("--ablation online trains the drafter: it needs one, in bfloat16 or float32")
    if args.head_draft_len is not None and args.head_draft_len < 1:
        raise OmnidraftError("--head-draft-len must be at least 1")
    train = train_config(args)
    stream, sets, held = _slices(args, stream_n)
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens, draft_len=args.draft_len, verify="greedy",
                          **draft_stop_options(args))
    decode.validate()
    pipe = load_pipeline(args.target, args.drafter, drafter_dtype=args.drafter_dtype, adapter="none",
                         cache=CacheOptions(enabled=False))
    encode = lambda recs: [encode_prompt(pipe.target_tokenizer, r.text, chat=r.chat) for r in recs]
    plan = OnlinePlan(stream=encode(stream), held_out={k: encode(v) for k, v in held.items()},
                      checkpoints=checkpoints_for(stream_n, args.checkpoints), interval=args.interval,
                      losses=losses, stream_sets=sets)
    records = RecordCache(args.records or args.out / "records.pt", records_meta(pipe, args.max_new_tokens, args.top_k))
    result = run_online(pipe, plan, decode, train, records, head_k=args.head_draft_len)
    meta = {"drafter": args.drafter, "target": args.target, "stream": args.prompts + (f" → {args.shift_to}" if args.shift_to else ""),
            "stream_n": stream_n, "offset": args.offset, "held_out": {k: len(v) for k, v in held.items()},
            "interval": args.interval, "checkpoints": plan.checkpoints, "losses": losses,
            "modes": modes_of(losses, train.head), "max_new_tokens": args.max_new_tokens, "draft_len": args.draft_len,
            **draft_stop_options(args), "head_draft_len": args.head_draft_len,
            "drafter_dtype": args.drafter_dtype, "train": asdict(train), "top_k": args.top_k,
            "shift_at": stream_n // 2 if args.shift_to else None, "threads": torch.get_num_threads()}
    files = write_online(args.out, result, meta)
    sys.stdout.write((args.out / "results.md").read_text())
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0
