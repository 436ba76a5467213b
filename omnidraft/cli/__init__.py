"""``omnidraft`` command line: one module per subcommand, each exposing ``register(subparsers)``.

Exit status: 0 ok; 1 the command ran but could not do its job (e.g. training produced nothing);
2 bad input or state (one line on stderr saying what to do, nothing changed on disk); 130 Ctrl-C;
141 when the reader of our output went away (``omnidraft … | head``), as any Unix tool.
Building the parser imports no torch, so ``--help`` and argument errors answer at once.
"""

from __future__ import annotations

import importlib
import os
import sys

from omnidraft.cli.options import CliParser
from omnidraft.errors import OmnidraftError

SUBCOMMANDS = ("chat", "generate", "serve", "export", "bench", "adapt", "adapters", "cache", "models", "experiment")


def build_parser() -> CliParser:
    parser = CliParser(prog="omnidraft", description="Cross-vocabulary speculative decoding with a tiny on-device drafter.")
    parser.add_argument("--home", help="state folder (adapters/, cache_store/, export/, models/); default $OMNIDRAFT_HOME or the cwd")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"omnidraft.cli.{name}").register(sub)
    return parser


def _use_home(home: str | None) -> None:
    """--home (or $OMNIDRAFT_HOME) must be a folder, or not exist yet (it is created on first write)."""
    if home:
        os.environ["OMNIDRAFT_HOME"] = home
    path = os.environ.get("OMNIDRAFT_HOME")
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise OmnidraftError(f"the home {path} is a file; give a folder with --home or $OMNIDRAFT_HOME")


def _quiet_broken_pipe() -> int:
    """Our reader left: point stdout at /dev/null so the interpreter's final flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _use_home(args.home)
        return int(args.func(args) or 0)
    except OmnidraftError as exc:
        print(f"omnidraft: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("omnidraft: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except OSError as exc:  # the environment: a read-only or full disk, a path we may not read
        where = f"cannot use {exc.filename}: " if exc.filename else ""
        print(f"omnidraft: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except MemoryError:
        print("omnidraft: error: out of memory (try a shorter prompt, fewer tokens, or a smaller model)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
