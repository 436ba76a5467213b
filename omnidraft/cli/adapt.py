"""``omnidraft adapt``: run a prompt stream through speculative decoding and distil the target into
the pair's LoRA adapter as it goes (OmniDraft Algorithm 2).

The stream is a batch job, so it follows Algorithm 2 to the letter: after every ``--interval``
prompts the update on the buffer runs before the next prompt starts (the trainer still lives in
its own low-priority process). That makes runs reproducible and the acceptance curve honest; in
``omnidraft chat`` the same trainer runs between turns without ever delaying a reply.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from omnidraft.cli.options import (
    COUNT,
    add_cache_options,
    add_decode_options,
    add_model_options,
    add_train_options,
    cache_options,
    check_adaptable,
    decode_config,
    integer,
    remote_options,
    train_config,
)
from omnidraft.data import PROMPTS_HELP
from omnidraft.errors import OmnidraftError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("adapt", help="stream prompts through speculative decoding and train the pair's LoRA adapter")
    p.add_argument("--stream", required=True, help=PROMPTS_HELP)
    p.add_argument("--n", type=COUNT, default=200, help="prompts to stream (default 200)")
    p.add_argument("--offset", type=integer(0), default=0, help="skip this many prompts of the set first")
    p.add_argument("--save-to", type=Path, default=None,
                   help="adapter folder: new, empty, or an adapter folder (default: the pair's under <home>/adapters)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    add_model_options(p)
    add_decode_options(p)
    add_cache_options(p)
    add_train_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from omnidraft.data import load_prompts
    from omnidraft.runtime import encode_prompt, load_pipeline
    from omnidraft.train.online import OnlineLearning

    config = decode_config(args)
    tcfg = train_config(args)
    if args.drafter in (None, "none"):
        raise OmnidraftError("adapt trains the drafter: give one with --drafter")
    check_adaptable(args, training=True)
    prompts = load_prompts(args.stream, n=args.n, offset=args.offset)
    if not prompts:
        raise OmnidraftError(f"--stream {args.stream} has no prompts at offset {args.offset}")
    _check_writable(args)  # before a minute of loading; OnlineLearning takes the lock for real
    pipe = load_pipeline(args.target, args.drafter, dtype=args.dtype, device=args.device, drafter_dtype=args.drafter_dtype,
                         cache=cache_options(args), quiet=args.json, adapter=args.adapter, engine=args.engine,
                         remote=remote_options(args), drafter_backend=args.drafter_backend)
    learner = OnlineLearning(pipe, tcfg, save_to=args.save_to, nice=0)
    rates: list[float] = []
    bar = tqdm(prompts, desc="adapt", unit="prompt", disable=args.json)
    try:
        for i, record in enumerate(bar, 1):
            result = pipe.decoder.generate(encode_prompt(pipe.target_tokenizer, record.text, chat=record.chat), config)
            rates.append(result.stats.acceptance_rate)
            if i % args.interval == 0:
                bar.set_postfix_str(f"accept {statistics.fmean(rates):.2f} (last {args.interval}: "
                                    f"{statistics.fmean(rates[-args.interval:]):.2f}) · training…")
                learner.wait()
            bar.set_postfix_str(f"accept {statistics.fmean(rates):.2f} (last {args.interval}: "
                                f"{statistics.fmean(rates[-args.interval:]):.2f}) · updates {_updates(pipe)}")
    finally:
        bar.close()
        learner.close(train_pending=True)
        pipe.close()
    return _report(args, pipe, learner, rates)


def _check_writable(args: argparse.Namespace) -> None:
    """Fail fast when the adapter folder cannot be written (foreign files, another trainer on it)."""
    from omnidraft.adapter import store

    folder = store.writable_pair_folder(args.save_to) if args.save_to else store.pair_dir(args.drafter, args.target)
    with store.writer_lock(folder):
        pass


def _updates(pipe) -> int:
    current = pipe.adapter_slot.current
    return int(current.meta.get("updates", 0)) if current is not None else 0


def _report(args: argparse.Namespace, pipe, learner, rates: list[float]) -> int:
    window = max(1, min(args.interval, len(rates) // 2 or 1))
    summary = {
        "prompts": len(rates), "records": learner.records, "updates": _updates(pipe),
        "adapter": str(pipe.adapter_slot.current.path) if pipe.adapter_slot.current else None,
        "acceptance_first": statistics.fmean(rates[:window]), "acceptance_last": statistics.fmean(rates[-window:]),
        "acceptance_mean": statistics.fmean(rates), "trainer_errors": learner.trainer.errors,
        "history": pipe.adapter_slot.current.meta.get("history", [])[-5:] if pipe.adapter_slot.current else [],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['prompts']} prompts, {summary['updates']} updates; acceptance first {window}: "
              f"{summary['acceptance_first']:.2f}, last {window}: {summary['acceptance_last']:.2f}")
        print(f"adapter: {summary['adapter']}")
        for err in learner.trainer.errors:
            print(f"omnidraft: trainer error: {err}", file=sys.stderr)
    if learner.trainer.errors and not learner.trainer.published:
        print("omnidraft: error: training published no adapter (see the trainer errors above and "
              f"{learner.trainer.log_path})", file=sys.stderr)
        return 1
    return 0
