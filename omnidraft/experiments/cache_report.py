"""Write the n-gram cache ablation: results.json, results.md (Table 14's shape plus the growth
summary), cache_growth.png (Figure 9's shape) and the bench's speedup / time-split charts."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

from omnidraft.bench.report import draft_policy, fmt, plot
from omnidraft.experiments.cache_ablation import (
    FULL,
    TARGET,
    AblationResult,
    GrowthPoint,
    curve_at,
)
from omnidraft.fsutil import atomic_write

GROWTH_MARKS = (0.25, 0.5, 0.75, 1.0)  # where the summary reads the growth rate off the curve


def _identical(row: dict) -> str:
    ident = row.get("identical_to_target")
    return "–" if ident is None else ("yes" if ident else "NO")


def _size_cell(name: str, cache: dict) -> tuple[str, str, str]:
    """(cache size, policy, n-grams) cells: Table 14 splits a capped row label like ``1/4 LRU``."""
    cap = cache.get("max_entries")
    if cap is not None:
        size, _, policy = name.partition(" ")
        return size, policy, f"{cache['entries']} (cap {cap})"
    return name, "–", "–" if name == TARGET else str(cache.get("entries", 0))


def ablation_table(summary: dict[str, dict]) -> str:
    """Held-out results in Table 14's shape, plus the columns that explain them."""
    head = ("| cache size | policy | n-grams | acceptance | tokens/target fwd | n-gram hits (acc/prop) | "
            "speedup vs target (median) | mean | tok/s | identical |")
    lines = [head, "|" + "---|" * 10]
    for name, r in summary.items():
        size, policy, entries = _size_cell(name, r.get("cache", {}))
        lines.append(
            f"| {size} | {policy} | {entries} | {fmt(r['acceptance_rate'])} | {fmt(r['tokens_per_target_forward'])} | "
            f"{r['ngram_hits_accepted']}/{r['ngram_hits_proposed']} | {fmt(r['speedup_vs_target'])}× | "
            f"{fmt(r['speedup_vs_target_mean'])}× | {r['tokens_per_s']:.2f} | {_identical(r)} |")
    return "\n".join(lines) + "\n"


def stream_table(stream_summary: dict[str, dict]) -> str:
    """What each cache did while it learned: its size, evictions and acceptance during the stream."""
    head = "| cache | cap | n-grams at end | evictions | acceptance | tokens/target fwd | n-gram hits (acc/prop) |"
    lines = [head, "|" + "---|" * 7]
    for name, r in stream_summary.items():
        cap = r.get("max_entries")
        lines.append(f"| {name} | {'–' if cap is None else cap} | {r['entries']} | {r['evictions']} | "
                     f"{fmt(r['acceptance_rate'])} | {fmt(r['tokens_per_target_forward'])} | "
                     f"{r['ngram_hits_accepted']}/{r['ngram_hits_proposed']} |")
    return "\n".join(lines) + "\n"


def growth_summary(curve: Sequence[GrowthPoint], full_footprint: dict) -> str:
    """Figure 9 in words: final size, memory (Table 4's footprint), growth rate along the stream."""
    last = curve[-1]
    rates = ", ".join(f"{curve_at(curve, m).growth_rate:.3f} after {m:.0%}" for m in GROWTH_MARKS)
    return (f"Stream: {last.prompts} prompts, {last.tokens} tokens decoded. Full cache: {last.entries} n-grams, "
            f"{full_footprint['bytes_in_memory'] / 1024:.1f} KiB in memory, "
            f"{full_footprint['bytes_on_disk'] / 1024:.1f} KiB on disk. "
            f"Growth rate (n-grams per decoded token): {rates} of the tokens.\n")


def meta_line(meta: dict) -> str:
    verify = meta["verify"] + (f" at T={meta['temperature']}" if meta["verify"] != "greedy" else "")
    return (f"drafter `{meta['drafter']}` → target `{meta['target']}`, prompts `{meta['prompts']}`: stream "
            f"{meta['stream_n']} (offset {meta['stream_offset']}), held-out {meta['n']} (offset {meta['heldout_offset']}), "
            f"{meta['max_new_tokens']} new tokens, token translation, {verify} verification, "
            f"{draft_policy(meta)}, drafter dtype {meta['drafter_dtype']}, "
            f"{meta['threads']} threads")


def markdown(meta: dict, result: AblationResult) -> str:
    return (f"# omnidraft bench --ablation cache\n\n{meta_line(meta)}\n\n"
            f"## Held-out evaluation (caches frozen; Table 14)\n\n{ablation_table(result.summary)}\n"
            f"## Cache growth over the stream (Figure 9)\n\n{growth_summary(result.growth[FULL], result.footprints[FULL])}\n"
            f"## During the stream (each cache learning online)\n\n{stream_table(result.stream_summary)}")


def plot_growth(result: AblationResult) -> bytes:
    """PNG: n-grams vs tokens decoded (full cache, and each capped cache flattening at its cap),
    and the full cache's growth rate, which falls when growth is sub-linear (Figure 9)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (size_ax, rate_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for name, curve in result.growth.items():
        xs, ys = [0] + [p.tokens for p in curve], [0] + [p.entries for p in curve]
        if name == FULL:
            size_ax.plot(xs, ys, label=name, lw=2.0, color="k", marker=".")
        else:  # LRU and LFU of one size often coincide: LFU is drawn dashed over LRU, so both show
            size_ax.plot(xs, ys, label=name, lw=1.5, ls=(0, (4, 3)) if name.endswith("LFU") else "-")
    size_ax.set_xlabel("tokens decoded (stream)")
    size_ax.set_ylabel("n-gram cache size (entries)")
    size_ax.set_title("cache size")
    size_ax.legend(fontsize=8)
    full_curve = result.growth[FULL]
    rate_ax.plot([p.tokens for p in full_curve], [p.growth_rate for p in full_curve], color="k", marker=".")
    rate_ax.set_xlabel("tokens decoded (stream)")
    rate_ax.set_ylabel("growth rate = cache size / tokens")
    rate_ax.set_title("growth rate (full cache)")
    rate_ax.set_ylim(bottom=0)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_ablation(out_dir: Path, meta: dict, result: AblationResult) -> list[Path]:
    """results.json, results.md, cache_growth.png, speedup.png, time_split.png under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "results.json", json.dumps({"meta": meta, **result.as_dict()}, indent=1).encode())
    atomic_write(out_dir / "results.md", markdown(meta, result).encode())
    atomic_write(out_dir / "cache_growth.png", plot_growth(result))
    return [out_dir / "results.json", out_dir / "results.md", out_dir / "cache_growth.png"] + plot(out_dir, result.summary)
