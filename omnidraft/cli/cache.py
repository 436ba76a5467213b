"""``omnidraft cache stats | clear | export``: look after the persistent n-gram caches.

Without ``--pair`` each command works on every ``*.sqlite`` store under ``<home>/cache_store``,
and ``stats`` and ``clear`` on the prompt-lookup histories there too (``lookup-*.sqlite3``, one per
target tokenizer). ``stats`` and ``export`` open stores read-only (frozen): a corrupt or foreign
file is reported in one line on stderr and skipped, the command goes on with the others and exits
0 (the next writer moves the file aside; inspecting must not change anything). ``clear`` opens
stores for writing, so a bad file is moved aside there, as the runtime would do; it deletes a
lookup history only after its metadata record shows omnidraft wrote it, and leaves anything else.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from omnidraft.cli.options import integer
from omnidraft.console import warn
from omnidraft.errors import OmnidraftError
from omnidraft.fsutil import atomic_write


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``cache`` and its three actions to the top-level parser."""
    parser = subparsers.add_parser("cache", help="inspect, clear or export the persistent n-gram caches",
                                   description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="cache_command", required=True)

    stats = actions.add_parser("stats", help="entries, size on disk and in memory, hit rates, top n-grams; "
                               "lookup histories")
    stats.add_argument("--json", action="store_true", help="print one JSON document")
    stats.add_argument("--pair", help="only this tokenizer pair id (the store's file name)")
    stats.add_argument("--top", type=integer(0, 10_000), default=10, help="how many top n-grams to show (default 10)")
    stats.set_defaults(func=cmd_stats)

    clear = actions.add_parser("clear", help="delete every entry of the caches, and the lookup histories")
    clear.add_argument("--pair", help="only this tokenizer pair id")
    clear.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    clear.set_defaults(func=cmd_clear)

    export = actions.add_parser("export", help="write the entries as JSON lines")
    export.add_argument("file", metavar="FILE.jsonl", help="output file ('-' for stdout)")
    export.add_argument("--pair", help="only this tokenizer pair id")
    export.set_defaults(func=cmd_export)


def _store_paths(pair: str | None, unusable: bool = False) -> list[Path]:
    """The stores a command works on; an unknown ``--pair`` is a user error. Creates nothing.
    ``unusable``: also what is named like a store but is no file (``stats`` reports it)."""
    from omnidraft.ngram.files import default_store_path, list_store_paths
    from omnidraft.identity import check_pair_id

    if pair is None:
        return list_store_paths(unusable=unusable)
    try:
        path = default_store_path(check_pair_id(pair))
    except ValueError as exc:
        raise OmnidraftError(str(exc)) from exc
    if not path.exists():
        raise OmnidraftError(f"no n-gram cache for pair {pair!r} under {path.parent}")
    return [path]


def _history_paths(pair: str | None) -> list[Path]:
    """The lookup history files (by name; checked before use), none when ``--pair`` picks a cache."""
    from omnidraft.ngram.files import list_history_paths

    return list_history_paths() if pair is None else []


def _open_frozen(path: Path) -> tuple[Any, str | None]:
    """Open read-only: (cache, None), or (None or an unused cache, the problem line printed on
    stderr). The line says what ``generate`` would do with the file, and is the same text the JSON
    report carries: a corrupt or foreign store (a writer moves it aside and starts empty), one that
    is no file or cannot be read (``generate`` stops with that line), a name that is no pair id."""
    from omnidraft.ngram.store import PersistentNgramCache

    try:
        cache = PersistentNgramCache(path, path.stem, frozen=True)
    except ValueError as exc:
        line = f"skipping {path}: {exc}"
    except OmnidraftError as exc:  # what inspect_store refuses before any sqlite: generate stops on it
        line = f"{exc} (generate and chat stop on it)"
    else:
        return cache, cache.problem  # a problem was already printed (report_problem)
    warn(line)
    return None, line


def _folder() -> Path:
    from omnidraft.ngram.files import store_folder

    return store_folder()


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def cmd_stats(args: argparse.Namespace) -> int:
    """Print per-store statistics (text or JSON); bad files are listed under ``problems``."""
    caches: list[dict[str, Any]] = []
    problems: list[dict[str, str]] = []
    for path in _store_paths(args.pair, unusable=True):
        cache, problem = _open_frozen(path)
        if problem is not None:  # `is not None`: an empty cache object is falsy
            problems.append({"path": str(path), "problem": problem})
            continue
        caches.append(cache.stats(top=args.top))
    histories = _history_stats(args.pair, problems)
    if args.json:
        doc = {"cache_store": str(_folder()), "caches": caches, "lookup_histories": histories, "problems": problems}
        print(json.dumps(doc, indent=2))
        return 0
    if not caches:
        unusable = [p for p in problems if not Path(p["path"]).name.startswith("lookup-")]
        print(f"no usable n-gram caches under {_folder()} ({len(unusable)} reported above)" if unusable
              else f"no n-gram caches under {_folder()}")
    for s in caches:
        _print_stats(s)
    for h in histories:
        print(f"lookup history of target tokenizer {h['target'][:16] if h['target'] else '?'}  ({h['path']})")
        print(f"  entries {h['entries']}   on disk {_human_bytes(h['bytes_on_disk'])}")
    return 0


def _history_stats(pair: str | None, problems: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Entries and bytes of each lookup history, read without writing; a bad one is one line on
    stderr and a ``problems`` entry, left where it is (the runtime sets it aside)."""
    import sqlite3

    from omnidraft.ngram.files import StoreProblem, describe_history

    out = []
    for path in _history_paths(pair):
        try:
            out.append(describe_history(path))
        except StoreProblem as exc:
            problem = f"lookup history {path} is {exc.kind} ({exc.detail})"
        except (sqlite3.Error, OSError) as exc:
            problem = f"cannot read lookup history {path}: {exc}"
        else:
            continue
        warn(problem)
        problems.append({"path": str(path), "problem": problem})
    return out


def _print_stats(s: dict[str, Any]) -> None:
    rate = f"{100 * s['accept_rate']:.1f}%" if s["accept_rate"] is not None else "n/a"
    print(f"pair {s['pair_id']}  ({s['path']})")
    print(f"  entries {s['entries']}   on disk {_human_bytes(s['bytes_on_disk'])}   "
          f"in memory ~{_human_bytes(s['bytes_in_memory'])}")
    print(f"  hits proposed {s['hits_proposed']}   accepted {s['hits_accepted']}   accept rate {rate}")
    if s["skipped_rows"]:
        print(f"  malformed rows skipped {s['skipped_rows']}")
    if s["top"]:
        print("  top n-grams (drafter ids -> target id, accepted/proposed):")
        for t in s["top"]:
            print(f"    {t['drafter_ids']} -> {t['target_id']}   {t['accepted']}/{t['proposed']}")


def cmd_clear(args: argparse.Namespace) -> int:
    """Empty the selected stores (one transaction each); asks first unless ``--yes``."""
    paths, histories = _store_paths(args.pair), _history_paths(args.pair)
    if not paths and not histories:
        print(f"no n-gram caches under {_folder()}")
        return 0
    what = f"{len(paths)} n-gram cache(s)" + (f" and {len(histories)} lookup history file(s)" if histories else "")
    if not args.yes:
        if not sys.stdin.isatty():
            raise OmnidraftError(f"refusing to clear {what} without --yes (no terminal to ask on)")
        try:
            answer = input(f"Delete every entry of {what}? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing cleared")
            return 0
    from omnidraft.ngram.store import PersistentNgramCache

    for path in paths:
        try:
            cache = PersistentNgramCache(path, path.stem)
        except ValueError as exc:
            warn(f"skipping {path}: {exc}")
            continue
        with cache:
            removed = cache.clear()
        print(f"cleared {removed} entries from pair {path.stem}")
    from omnidraft.ngram.files import StoreProblem, remove_history

    for path in histories:
        try:
            removed = remove_history(path)
        except StoreProblem as exc:  # not verifiably ours: left untouched
            warn(f"not removing {path}: {exc.kind} ({exc.detail}); it is not a lookup history omnidraft can verify")
            continue
        except OSError as exc:
            warn(f"could not remove {path}: {exc.strerror or exc}")
            continue
        print(f"removed lookup history {path.name} ({removed} entries)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """One JSON object per entry, to stdout as it is read, or to FILE atomically (a failed export
    never leaves a half-written FILE behind)."""
    if args.file != "-" and Path(args.file).is_dir():
        raise OmnidraftError(f"cannot export to {args.file}: it is a directory; give a file name")
    if args.file == "-":
        for line in _export_lines(args.pair):
            sys.stdout.write(line + "\n")
        return 0
    lines = list(_export_lines(args.pair))
    atomic_write(args.file, "".join(line + "\n" for line in lines))
    print(f"exported {len(lines)} entries to {args.file}", file=sys.stderr)
    return 0


def _export_lines(pair: str | None):
    for path in _store_paths(pair):
        cache, problem = _open_frozen(path)
        if cache is None or problem is not None:
            continue
        for key, meta in sorted(cache.entries()):
            yield json.dumps({"pair_id": cache.pair_id, "drafter_ids": list(key), "target_id": meta.target,
                              "proposed": meta.proposed, "accepted": meta.accepted, "last_used_us": meta.last_used})
