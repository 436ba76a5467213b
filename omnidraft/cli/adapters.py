"""``omnidraft adapters list | show | remove``: the per-target LoRA adapters under ``<home>/adapters``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from omnidraft.errors import OmnidraftError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("adapters", help="list, show or remove the trained per-target LoRA adapters")
    actions = p.add_subparsers(dest="adapters_command", required=True)
    ls = actions.add_parser("list", help="one line per (drafter, target) pair")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)
    show = actions.add_parser("show", help="metadata and recent training metrics of one adapter")
    show.add_argument("name", help="pair folder name (as `adapters list` prints it) or a path")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_show)
    rm = actions.add_parser("remove", help="delete a pair's adapter (every version)")
    rm.add_argument("name", help="pair folder name or a path")
    rm.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    rm.set_defaults(func=cmd_remove)


def _describe(folder: Path) -> dict:
    """One adapter's row: its live version and counters, or what is wrong with it. The weights are
    read and checked too: "ok" means generate would use it."""
    from omnidraft.adapter import store

    row: dict = {"name": folder.name, "path": str(folder), "bytes_on_disk": _size(folder)}
    try:
        loaded = store.load(folder, None)
    except store.AdapterProblem as exc:
        return dict(row, status=f"unusable: {exc}")
    except OSError as exc:
        return dict(row, status=f"unreadable: {exc.strerror or exc}")
    if loaded is None:
        return dict(row, status="empty")
    meta = loaded.meta
    last = (meta.get("history") or [{}])[-1]
    return dict(row, status="ok", version=meta.get("version"), drafter=meta.get("drafter"), target=meta.get("target"),
                updates=meta.get("updates", 0), records_seen=meta.get("records_seen", 0),
                tokens_seen=meta.get("tokens_seen", 0), saved_at=meta.get("saved_at"),
                last_update=last, train_config=meta.get("train_config"), history=meta.get("history", []),
                head=loaded.head_state is not None)


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _resolve(name: str) -> Path:
    """For show: a pair folder name under the home's adapters/, or any adapter folder path (read only)."""
    from omnidraft.adapter.store import adapters_root

    path = Path(name).expanduser()
    candidate = adapters_root() / name
    if "/" not in name and name not in (".", "..") and candidate.is_dir():
        return candidate
    if path.is_dir():
        return path
    raise OmnidraftError(f"no adapter named {name!r}; `omnidraft adapters list` shows them")


def cmd_list(args: argparse.Namespace) -> int:
    from omnidraft.adapter import store

    rows = [_describe(folder) for folder in store.list_pairs()]
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "history"} for r in rows]))
        return 0
    if not rows:
        print("no adapters yet: `omnidraft adapt` or `omnidraft chat` trains one")
        return 0
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['name']}  {r['status']}")
            continue
        last = r["last_update"]
        print(f"{r['name']}  v{r['version']}  {r['updates']} updates  {r['records_seen']} prompts  "
              f"{r['tokens_seen']} tokens  {r['bytes_on_disk'] / 1e6:.1f} MB  "
              f"expected acceptance {last.get('expected_acceptance', 0):.2f}  top-1 {last.get('top1_agreement', 0):.2f}  "
              f"saved {_when(r['saved_at'])}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    row = _describe(_resolve(args.name))
    if args.json:
        print(json.dumps(row))
        return 0
    for key in ("name", "path", "status", "version", "drafter", "target", "updates", "records_seen", "tokens_seen"):
        if key in row:
            print(f"{key:13s} {row[key]}")
    if row.get("saved_at"):
        print(f"{'saved':13s} {_when(row['saved_at'])}")
    cfg = row.get("train_config") or {}
    if cfg:
        print(f"{'training':13s} loss {cfg.get('loss')} (n-gram weight {cfg.get('ngram_weight')}, λ {cfg.get('lam')}), "
              f"lr {cfg.get('lr')}, rank {cfg.get('rank')}, alpha {cfg.get('alpha')}, batch {cfg.get('batch_size')}"
              + (f"; acceptance head lr {cfg.get('head_lr')}, {cfg.get('head_epochs')} passes" if cfg.get("head") else ""))
    history = row.get("history", [])
    if history:
        print("recent updates (measured on each update's own prompts, before its optimizer steps):")
        print("  loss     dm KL    n-gram NLL  exp. acceptance  top-1   tokens  head AUC  seconds")
        for h in history[-10:]:
            get = lambda k: h.get(k, 0)  # noqa: E731 - a short accessor for the row below
            auc = f"{get('head_auc'):.3f}" if get("head_positions") else "  –  "  # adapters from before the head
            print(f"  {get('loss'):.4f}  {get('dm_kl'):.4f}  {get('ngram_nll'):.4f}      {get('expected_acceptance'):.3f}"
                  f"            {get('top1_agreement'):.3f}   {int(get('dm_tokens') + get('ngram_tokens')):6d}  {auc}     "
                  f"{get('seconds'):.1f}")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    """Delete a pair's adapter: only a pair folder omnidraft made under ``<home>/adapters``."""
    from omnidraft.adapter import store

    folder = store.owned_pair_folder(args.name)
    if not args.yes:
        if not sys.stdin.isatty():
            raise OmnidraftError(f"refusing to remove {folder} without --yes (no terminal to ask on)")
        try:
            answer = input(f"remove every version of the adapter in {folder}? [y/N] ").strip().lower()
        except EOFError:
            answer = ""
        if answer not in ("y", "yes"):
            print("nothing removed")
            return 0
    store.remove(folder)
    print(f"removed {folder}")
    return 0


def _when(ts: float | None) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "?"
    except (OverflowError, OSError, ValueError):
        return "?"
