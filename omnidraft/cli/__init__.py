"""``omnidraft`` command line: one module per subcommand, each exposing ``register(subparsers)``.

Every user-facing failure is an :class:`OmnidraftError`; ``main`` prints it as one line and exits
with status 2 (no traceback), as argparse does for bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from omnidraft.errors import OmnidraftError

SUBCOMMANDS = ("chat", "generate", "models", "cache", "bench", "adapt", "adapters")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnidraft", description="Cross-vocabulary speculative decoding with a tiny on-device drafter.")
    parser.add_argument("--home", help="state folder (adapters/, cache_store/, export/, models/); default $OMNIDRAFT_HOME or the cwd")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"omnidraft.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"omnidraft.cli.{name}":
                continue  # subcommand not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.home:
        os.environ["OMNIDRAFT_HOME"] = args.home
    try:
        return int(args.func(args) or 0)
    except OmnidraftError as exc:
        print(f"omnidraft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("omnidraft: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
