"""``omnidraft chat``: argparse glue for the interactive session in ``omnidraft/chat.py``."""

from __future__ import annotations

import argparse
from functools import partial

from omnidraft.cli.adapt import add_train_args, train_config
from omnidraft.cli.generate import add_decode_args, cache_options, decode_config
from omnidraft.errors import OmnidraftError

CHAT_MAX_NEW_TOKENS = 512  # a chat reply may be long; Ctrl-C stops it early


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a target in the terminal; the drafter speeds it up and learns as you go",
                       description="Interactive chat: replies stream as the target accepts them, one status line per "
                                   "reply, slash commands (/help). State (n-gram cache, history) persists in the home.")
    add_decode_args(p)
    p.set_defaults(max_new_tokens=CHAT_MAX_NEW_TOKENS)
    p.add_argument("--system", help="system prompt for the conversation")
    p.add_argument("--context-window", type=int, default=None,
                   help="most tokens of conversation + reply the target sees; the oldest turns are dropped beyond it "
                        "(default 4096, capped by the target's position limit)")
    p.add_argument("--no-train", action="store_true", help="do not let the trainer learn from this conversation")
    add_train_args(p, interval=1)
    # Also accepted after the subcommand; SUPPRESS keeps `omnidraft --home H chat` working.
    p.add_argument("--home", default=argparse.SUPPRESS, help="state folder (as the global --home)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from omnidraft.chat import ChatSession
    from omnidraft.runtime import load_pipeline

    config = decode_config(args)
    if args.context_window is not None and args.context_window < 2:
        raise OmnidraftError("--context-window must be at least 2 tokens")
    if args.context_window is not None and args.context_window <= args.max_new_tokens:
        raise OmnidraftError(f"--context-window {args.context_window} leaves no room for a prompt with "
                             f"--max-new-tokens {args.max_new_tokens}")
    tcfg = train_config(args)
    if not args.no_train and args.drafter_dtype == "int8":
        raise OmnidraftError("an int8 drafter cannot take a LoRA adapter; use --drafter-dtype bfloat16, or --no-train")
    loader = partial(_load, load_pipeline, drafter=args.drafter, dtype=args.dtype, adapter=args.adapter,
                     drafter_dtype=args.drafter_dtype, cache=cache_options(args))
    learner = partial(_learner, config=tcfg, interval=args.interval, top_k=args.top_k)
    session = ChatSession(loader(args.target), loader, config, system=args.system,
                          context_window=args.context_window, train=not args.no_train, learner_factory=learner)
    return session.run()


def _learner(pipeline, *, config, interval: int, top_k: int):
    """Online learning for one pipeline: records each reply, trains the pair's adapter between turns."""
    from omnidraft.train.online import OnlineLearning

    return OnlineLearning(pipeline, config, interval, top_k=top_k)


def _load(load_pipeline, target: str, *, drafter: str, **options):
    """Load one target with the session's drafter and options (also what /target calls)."""
    return load_pipeline(target, drafter, **options)
