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

from omnidraft.cli.generate import add_decode_args, cache_options, decode_config
from omnidraft.errors import OmnidraftError

DEFAULT_INTERVAL = 8


def add_train_args(parser: argparse.ArgumentParser, interval: int = DEFAULT_INTERVAL, loss: bool = True) -> None:
    """Trainer options shared by adapt, chat and the online bench (defaults: OmniDraft Appendix A.2);
    ``loss=False`` leaves out --loss for a caller that compares losses itself."""
    from omnidraft.train.distill import TrainConfig
    from omnidraft.train.loss import DIVERGENCES, LOSS_KINDS, NGRAM_WEIGHTS
    from omnidraft.train.records import DEFAULT_TOP_K

    d = TrainConfig()
    g = parser.add_argument_group("training")
    g.add_argument("--interval", type=int, default=interval, help=f"prompts per update, I (default {interval})")
    if loss:
        g.add_argument("--loss", choices=LOSS_KINDS, default=d.loss, help="dm: L_DM only; hybrid: L_DM + λ·L_N-gram (eq. 3)")
    g.add_argument("--ngram-weight", choices=NGRAM_WEIGHTS, default=d.ngram_weight,
                   help="weight of the n-gram NLL: const (λ) or target-prob (the verified p(t))")
    g.add_argument("--lambda", dest="lam", type=float, default=d.lam, help=f"λ for --ngram-weight const (default {d.lam})")
    g.add_argument("--span-weight", type=float, default=d.span_weight,
                   help="NLL weight on drafter tokens that straddle a target-token boundary (code line breaks; "
                        f"not in eq. (4), default {d.span_weight:g}: off)")
    g.add_argument("--lr", type=float, default=d.lr, help=f"AdamW learning rate, constant (default {d.lr})")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help=f"prompts per optimizer step (default {d.batch_size})")
    g.add_argument("--epochs", type=int, default=d.epochs,
                   help=f"passes over the buffer per update (default {d.epochs}, Algorithm 2)")
    g.add_argument("--divergence", choices=DIVERGENCES, default=d.divergence,
                   help="at DM positions: reverse-kl (eq. 4, default), forward-kl or tvd (one minus the sampling acceptance rate)")
    g.add_argument("--target-temperature", type=float, default=d.target_temperature,
                   help=f"distil towards the target's distribution sharpened to this temperature (default {d.target_temperature:g})")
    g.add_argument("--rank", type=int, default=d.rank, help=f"LoRA rank (default {d.rank})")
    g.add_argument("--alpha", type=float, default=d.alpha, help=f"LoRA alpha; scaling = alpha/rank (default {d.alpha:g})")
    g.add_argument("--head", action=argparse.BooleanOptionalAction, default=d.head,
                   help="train the acceptance head beside the adapter (§3.3, Algorithm 3; default on)")
    g.add_argument("--head-lr", type=float, default=d.head_lr, help=f"acceptance head learning rate (default {d.head_lr:g})")
    g.add_argument("--head-epochs", type=int, default=d.head_epochs,
                   help=f"passes of the head over each update's positions (default {d.head_epochs})")
    g.add_argument("--head-reject-weight", type=float, default=d.head_reject_weight,
                   help=f"BCE weight of rejected tokens (default {d.head_reject_weight:g}: calibrated probabilities)")
    g.add_argument("--head-replay", type=int, default=d.head_replay,
                   help="the head also re-fits on this many earlier prompts, relabelled by the updated drafter "
                        "(Algorithm 4's buffer R; default 0: Algorithm 3)")
    g.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help=f"target log-probs kept per position (default {DEFAULT_TOP_K})")


def train_config(args: argparse.Namespace):
    from omnidraft.train.distill import TrainConfig

    if args.interval < 1 or args.top_k < 1:
        raise OmnidraftError("--interval and --top-k must be at least 1")
    config = TrainConfig(loss=getattr(args, "loss", "hybrid"), ngram_weight=args.ngram_weight, lam=args.lam, span_weight=args.span_weight, lr=args.lr,
                         batch_size=args.batch_size, rank=args.rank, alpha=args.alpha, epochs=args.epochs,
                         target_temperature=args.target_temperature, divergence=args.divergence, head=args.head, head_lr=args.head_lr,
                         head_epochs=args.head_epochs, head_reject_weight=args.head_reject_weight,
                         head_replay=args.head_replay)
    try:
        config.validate()
    except ValueError as exc:
        raise OmnidraftError(str(exc)) from None
    return config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("adapt", help="stream prompts through speculative decoding and train the pair's LoRA adapter")
    add_decode_args(p)
    p.add_argument("--stream", required=True, help="humaneval | alpaca | xsum | asdiv | path/to/file.jsonl")
    p.add_argument("--n", type=int, default=200, help="prompts to stream (default 200)")
    p.add_argument("--offset", type=int, default=0, help="skip this many prompts of the set first")
    p.add_argument("--save-to", type=Path, default=None, help="adapter folder (default: the pair's under <home>/adapters)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    add_train_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from omnidraft.data import load_prompts
    from omnidraft.runtime import encode_prompt, load_pipeline
    from omnidraft.train.online import OnlineLearning

    config = decode_config(args)
    tcfg = train_config(args)
    if args.n < 1 or args.offset < 0:
        raise OmnidraftError("--n must be at least 1 and --offset at least 0")
    if args.drafter in (None, "none"):
        raise OmnidraftError("adapt trains the drafter: give one with --drafter")
    if args.drafter_dtype == "int8":
        raise OmnidraftError("an int8 drafter cannot take a LoRA adapter; use --drafter-dtype bfloat16 or float32")
    prompts = load_prompts(args.stream, n=args.n, offset=args.offset)
    if not prompts:
        raise OmnidraftError(f"--stream {args.stream} has no prompts at offset {args.offset}")
    pipe = load_pipeline(args.target, args.drafter, dtype=args.dtype, drafter_dtype=args.drafter_dtype,
                         cache=cache_options(args), quiet=args.json, adapter=args.adapter)
    learner = OnlineLearning(pipe, tcfg, args.interval, top_k=args.top_k, save_to=args.save_to, nice=0)
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
    return _report(args, pipe, learner, rates)


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
            print(f"trainer error: {err}", file=sys.stderr)
    return 0
