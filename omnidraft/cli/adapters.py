"""``omnidraft adapters list | show | remove``: the per-target LoRA adapters under ``<home>/adapters``."""

from __future__ import annotations

import argparse
import json
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
    """One adapter's row: its live version and counters, or what is wrong with it."""
    from omnidraft.train import adapter_store

    row: dict = {"name": folder.name, "path": str(folder), "bytes_on_disk": _size(folder)}
    try:
        version_dir = adapter_store.current_version_dir(folder)
        if version_dir is None:
            return dict(row, status="empty")
        meta = adapter_store.read_meta(version_dir)
    except adapter_store.AdapterProblem as exc:
        return dict(row, status=f"unusable: {exc}")
    last = (meta.get("history") or [{}])[-1]
    return dict(row, status="ok", version=meta.get("version"), drafter=meta.get("drafter"), target=meta.get("target"),
                updates=meta.get("updates", 0), records_seen=meta.get("records_seen", 0),
                tokens_seen=meta.get("tokens_seen", 0), saved_at=meta.get("saved_at"),
                last_update=last, train_config=meta.get("train_config"), history=meta.get("history", []))


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _resolve(name: str) -> Path:
    from omnidraft.train.adapter_store import adapters_root

    path = Path(name).expanduser()
    if path.is_dir():
        return path
    candidate = adapters_root() / name
    if "/" not in name and candidate.is_dir():
        return candidate
    raise OmnidraftError(f"no adapter named {name!r}; `omnidraft adapters list` shows them")


def cmd_list(args: argparse.Namespace) -> int:
    from omnidraft.train import adapter_store

    rows = [_describe(folder) for folder in adapter_store.list_pairs()]
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
    if row.get("train_config"):
        cfg = row["train_config"]
        print(f"{'training':13s} loss {cfg['loss']} (n-gram weight {cfg['ngram_weight']}, λ {cfg['lam']}), lr {cfg['lr']}, "
              f"rank {cfg['rank']}, alpha {cfg['alpha']}, batch {cfg['batch_size']}"
              + (f"; acceptance head lr {cfg['head_lr']}, {cfg['head_epochs']} passes" if cfg.get("head") else ""))
    history = row.get("history", [])
    if history:
        print("recent updates (measured on each update's own prompts, before its optimizer steps):")
        print("  loss     dm KL    n-gram NLL  exp. acceptance  top-1   tokens  head AUC  seconds")
        for h in history[-10:]:
            auc = f"{h['head_auc']:.3f}" if h.get("head_positions") else "  –  "  # adapters from before the head
            print(f"  {h['loss']:.4f}  {h['dm_kl']:.4f}  {h['ngram_nll']:.4f}      {h['expected_acceptance']:.3f}"
                  f"            {h['top1_agreement']:.3f}   {h['dm_tokens'] + h['ngram_tokens']:6d}  {auc}     {h['seconds']:.1f}")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    from omnidraft.train import adapter_store

    folder = _resolve(args.name)
    if not args.yes:
        answer = input(f"remove every version of the adapter in {folder}? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print("nothing removed")
            return 1
    adapter_store.remove(folder)
    print(f"removed {folder}")
    return 0


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "?"
