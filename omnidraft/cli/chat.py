"""``omnidraft chat``: argparse glue for the interactive session in ``omnidraft/chat/``."""

from __future__ import annotations

import argparse
from functools import partial

from omnidraft.cli.options import (
    COUNT,
    add_cache_options,
    add_decode_options,
    add_model_options,
    add_train_options,
    cache_options,
    check_adaptable,
    decode_config,
    remote_options,
    text,
    train_config,
)
from omnidraft.errors import OmnidraftError

CHAT_INTERVAL = 1  # a turn is a prompt: train between every two turns


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a target in the terminal; the drafter speeds it up and learns as you go",
                       description="Interactive chat: replies stream as the target accepts them, one status line per "
                                   "reply, slash commands (/help). State (n-gram cache, adapter, history) persists in the home.")
    add_model_options(p)
    add_decode_options(p)
    add_cache_options(p)
    p.add_argument("--system", type=text, help="system prompt for the conversation")
    p.add_argument("--context-window", type=COUNT, default=None,
                   help="most tokens of conversation + reply the target sees; the oldest turns are dropped beyond it "
                        "(default 4096, capped by the target's context)")
    p.add_argument("--no-train", action="store_true", help="do not let the trainer learn from this conversation")
    add_train_options(p)
    p.set_defaults(interval=CHAT_INTERVAL)  # --interval counts turns in a chat
    # Also accepted after the subcommand; SUPPRESS keeps `omnidraft --home H chat` working.
    p.add_argument("--home", default=argparse.SUPPRESS, help="state folder (as the global --home)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from omnidraft.chat import ChatSession
    from omnidraft.runtime import load_pipeline

    config = decode_config(args)
    if args.context_window is not None and args.context_window <= config.max_new_tokens:
        raise OmnidraftError(f"--context-window {args.context_window} leaves no room for a prompt with "
                             f"--max-new-tokens {config.max_new_tokens}")
    tcfg = train_config(args)
    check_adaptable(args, training=not args.no_train)
    loader = partial(_load, load_pipeline, drafter=args.drafter, dtype=args.dtype, device=args.device, adapter=args.adapter,
                     drafter_dtype=args.drafter_dtype, cache=cache_options(args), engine=args.engine,
                     remote=remote_options(args), drafter_backend=args.drafter_backend)
    session = ChatSession(loader(args.target), loader, config, system=args.system,
                          context_window=args.context_window, train=not args.no_train,
                          learner_factory=partial(_learner, config=tcfg))
    return session.run()


def _learner(pipeline, *, config):
    """Online learning for one pipeline: records each reply, trains the pair's adapter between turns."""
    from omnidraft.train.online import OnlineLearning

    return OnlineLearning(pipeline, config)


def _load(load_pipeline, target: str, *, drafter: str, **options):
    """Load one target with the session's drafter and options (also what /target calls)."""
    return load_pipeline(target, drafter, **options)
