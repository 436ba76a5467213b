"""``omnidraft export``: the drafter as an ONNX folder for onnxruntime (apps, and ``--drafter-backend onnx``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omnidraft.cli.options import DEFAULT_DRAFTER, text
from omnidraft.errors import OmnidraftError

QUANTS = ("fp32", "int8")  # omnidraft.export.onnx_export checks the same names


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export the drafter (and its trained adapters) to ONNX for onnxruntime",
                       description="Write one folder under <home>/export/: the drafter as an ONNX decoder with KV cache "
                                   "and LoRA inputs, its tokenizer, the vocabulary bridge per target as .npy tables, "
                                   "each trained adapter as an .onnx_adapter, and a manifest. See export/README.md.")
    p.add_argument("--drafter", type=text, default=DEFAULT_DRAFTER, help="the drafter to export")
    p.add_argument("--quant", choices=QUANTS, default="int8",
                   help="weights of the base MatMuls: int8 (default: fastest, see docs/onnx.md) or fp32")
    p.add_argument("--target", type=text, action="append", default=None,
                   help="write the vocabulary bridge for this target (repeatable; default: the builtin targets "
                        "and every target with a trained adapter)")
    p.add_argument("--adapter", type=text, default=None,
                   help="add or refresh adapters without re-exporting the graph: a pair folder name, or 'all'")
    p.add_argument("--merge-adapter", type=text, default=None, metavar="NAME",
                   help="merge this pair's trained adapter (a folder name from `omnidraft adapters list`) into the "
                        "weights: one target's drafter with no LoRA branches, at the base graph's cost per token; "
                        "it takes no other adapter (default folder <home>/export/<NAME>-<quant>)")
    p.add_argument("--attention", choices=("fused", "plain"), default="fused",
                   help="fused (default): onnxruntime's GroupQueryAttention node per layer (its contrib operators, in "
                        "every standard build; faster); plain: standard ONNX operators only, for a runtime built "
                        "without the contrib operators")
    p.add_argument("--out", type=Path, default=None, help="the export folder (default <home>/export/<drafter>-<quant>)")
    p.set_defaults(func=run)


def default_folder(drafter: str, quant: str) -> Path:
    from omnidraft.home import home_dir
    from omnidraft.identity import spec_slug

    return home_dir() / "export" / f"{spec_slug(drafter)}-{quant}"


def run(args: argparse.Namespace) -> int:
    """Export the drafter, or (``--adapter``) add trained adapters to an export, under the export's
    lock, after finishing or cleaning up what an interrupted export left."""
    from omnidraft.export.folder import holding, leftovers, recover

    if args.merge_adapter is not None and args.adapter is not None:
        raise OmnidraftError("--merge-adapter exports a graph with one adapter in its weights; --adapter adds "
                             "adapters to an export that takes them: give one of the two")
    merged = None
    if args.merge_adapter is not None:  # a trained pair's adapter, loaded before anything is locked or written
        merged = _merged_adapter(_adapter_names(args.merge_adapter)[0])
    out = args.out or (default_folder(args.drafter, args.quant) if args.merge_adapter is None else
                       default_folder(args.merge_adapter, args.quant))
    if args.adapter is None:
        from omnidraft import models

        models.check_spec(args.drafter)  # before anything is locked or written
    else:
        if args.adapter != "all":
            _adapter_names(args.adapter)  # a NAME that is no plain name is refused before anything else
        if not out.is_dir() and not leftovers(out):
            raise OmnidraftError(f"no export at {out}: run `omnidraft export` first (adapters go into an export)")
    with holding(out):
        for done in recover(out):
            print(f"omnidraft: {done} (left by an interrupted export)", file=sys.stderr)
        if args.adapter is None:
            return _export_graph(args, out, merged)
        if not out.is_dir():
            raise OmnidraftError(f"no export at {out}: run `omnidraft export` first (adapters go into an export)")
        for name in _adapter_names(args.adapter):
            _export_adapter(out, name, quiet_if_empty=args.adapter == "all")
    return 0


def _adapter_names(given: str) -> list[str]:
    """The pair folders ``--adapter`` designates: every real pair folder for 'all' (links out of the
    home are skipped with a warning), else the one plain NAME, which must be a pair folder itself."""
    from omnidraft.adapter import store
    from omnidraft.console import warn
    from omnidraft.export.manifest import check_name

    if given == "all":
        names = []
        for folder in store.list_pairs():
            if folder.is_symlink():
                warn(f"skipping {folder}: a symbolic link, not an adapter folder of this home")
            else:
                names.append(folder.name)
        return names
    name = check_name(given, "--adapter")
    folder = store.adapters_root() / name
    if folder.is_symlink():
        raise OmnidraftError(f"--adapter {name!r} is a symbolic link, not an adapter folder under {store.adapters_root()}")
    return [name]


def _export_graph(args: argparse.Namespace, out: Path, merged=None) -> int:
    from omnidraft import models
    from omnidraft.adapter import store
    from omnidraft.export.folder import check_replaceable
    from omnidraft.export.onnx_export import export_drafter
    from omnidraft.kv import output_vocab_size
    from omnidraft.vocab.bridge import VocabBridge
    from omnidraft.identity import spec_slug

    check_replaceable(out)  # before a minute of work, not after it
    model, tokenizer = models.load(args.drafter, dtype="float32")
    targets = args.target or ([merged.meta["target"]] if merged is not None and merged.meta.get("target") else
                              [m.spec for m in models.BUILTINS.values() if m.name != "smollm2-135m"
                               and models.part_files(m) is not None])
    bridges = {}
    for spec in targets:
        t_tok = models.load_tokenizer(spec)
        size = max(len(t_tok), max(t_tok.get_vocab().values()) + 1)
        bridges[spec_slug(spec)] = VocabBridge(tokenizer, t_tok, output_vocab_size(model), size)
    builtin = models.builtin(args.drafter)
    what = f" with {args.merge_adapter} merged in" if merged is not None else ""
    print(f"omnidraft: exporting {args.drafter} ({args.quant}){what} to {out} …", file=sys.stderr)
    export_drafter(model, tokenizer, out, quant=args.quant, spec=args.drafter,
                   model_sha256=builtin.sha256 if builtin else "", bridges=bridges, merged=merged,
                   attention=args.attention)
    if merged is not None:
        print(out)
        return 0
    for folder in store.list_pairs():
        if folder.name.startswith(f"{spec_slug(args.drafter)}--") and not folder.is_symlink():
            _export_adapter(out, folder.name, quiet_if_empty=True)
    print(out)
    return 0


def _trained_adapter(name: str, what: str):
    """The published adapter of the pair folder ``name`` under the home, or None when it has none;
    a damaged one is an error that starts with ``what``."""
    from omnidraft.adapter import store

    folder = store.adapters_root() / name
    try:
        return store.load(folder, None) if folder.is_dir() else None
    except store.AdapterProblem as exc:
        raise OmnidraftError(f"{what}: {exc}") from None


def _merged_adapter(name: str):
    """The trained adapter ``--merge-adapter`` names, loaded (its fit is checked when merging)."""
    loaded = _trained_adapter(name, f"--merge-adapter {name}")
    if loaded is None:
        raise OmnidraftError(f"--merge-adapter {name}: no trained adapter there; `omnidraft adapters list` shows them")
    return loaded


def _export_adapter(out: Path, name: str, quiet_if_empty: bool = False) -> None:
    from omnidraft.export.onnx_export import export_adapter

    loaded = _trained_adapter(name, f"adapter {name}")
    if loaded is None:
        if quiet_if_empty:
            return
        raise OmnidraftError(f"no trained adapter named {name!r}; `omnidraft adapters list` shows them")
    path = export_adapter(loaded, out, name)
    print(f"omnidraft: adapter {name} (version {loaded.version}) -> {path}", file=sys.stderr)
