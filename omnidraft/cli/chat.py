"""``omnidraft chat``: argparse glue for the interactive session in ``omnidraft/chat.py``."""

from __future__ import annotations

import argparse
from functools import partial

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
    loader = partial(_load, load_pipeline, drafter=args.drafter, dtype=args.dtype,
                     drafter_dtype=args.drafter_dtype, cache=cache_options(args))
    session = ChatSession(loader(args.target), loader, config, system=args.system,
                          context_window=args.context_window, train=not args.no_train)
    return session.run()


def _load(load_pipeline, target: str, *, drafter: str, **options):
    """Load one target with the session's drafter and options (also what /target calls)."""
    return load_pipeline(target, drafter, **options)
