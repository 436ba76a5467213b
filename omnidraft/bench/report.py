"""Write a bench run: results.json (machine-readable), results.md (the table), PNG charts."""

from __future__ import annotations

import json
from pathlib import Path

from omnidraft.fsutil import atomic_write


def fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def markdown_table(summary: dict[str, dict]) -> str:
    head = ("| mode | tok/s | speedup vs baseline (median) | mean | acceptance | tokens/target fwd | drafted steps | "
            "lookup steps (tokens acc/prop) | n-gram hits (acc/prop) | draft/verify/bridge/other s | "
            "drafter ms/token (+ catch-up s) | identical | "
            "first token ms | inter-token ms (median/p90) |")
    lines = [head, "|" + "---|" * 14]
    for mode, r in summary.items():
        split = r["time_split_s"]
        lines.append(
            f"| {mode} | {r['tokens_per_s']:.2f} | {fmt(r['speedup_vs_target'])}× | {fmt(r['speedup_vs_target_mean'])}× | "
            f"{fmt(r['acceptance_rate'])} | {fmt(r['tokens_per_target_forward'])} | {_drafted(r)} | {_lookup(r)} | "
            f"{r['ngram_hits_accepted']}/{r['ngram_hits_proposed']} | "
            f"{split['draft']:.1f}/{split['verify']:.1f}/{split['bridge']:.1f}/{split['other']:.1f} | "
            f"{fmt(r.get('drafter_ms_per_token'), '.1f')} (+{r.get('catch_up_s', 0.0):.1f}) | {_identical(r)} | {fmt(r.get('ttft_ms'), '.0f')} | "
            f"{fmt(r.get('itl_ms_median'), '.0f')}/{fmt(r.get('itl_ms_p90'), '.0f')} |")
    return "\n".join(lines) + "\n"


def _drafted(row: dict) -> str:
    steps = row.get("steps") or 0
    return f"{row.get('drafted_steps', 0)}/{steps}" if steps else "–"


def _identical(row: dict) -> str:
    """yes, NO (k of n prompts identical), or – for a mode not compared (sampling)."""
    ident = row.get("identical_to_target")
    if ident is None:
        return "–"
    return "yes" if ident else f"NO ({row.get('identical_prompts', 0)}/{row['prompts']})"


def _lookup(row: dict) -> str:
    steps = row.get("lookup_steps") or 0
    return f"{steps} ({row.get('lookup_accepted', 0)}/{row.get('lookup_proposed', 0)})" if steps else "–"


def policy_lines(policy: dict[str, dict]) -> str:
    """What the cost-aware draft policy measured and chose, one line per mode."""
    lines = []
    for mode, p in policy.items():
        costs = ", ".join(f"{k}: {v:.0f}" for k, v in p["verify_ms_by_proposals"].items())
        plain = p["budget_choices"].get(0, 0)
        total = sum(p["budget_choices"].values())
        weights = p.get("weights_requests")
        chosen = (f"; requests by weights: {', '.join(f'{k} {v}' for k, v in weights.items())}" if weights else "")
        trials = f"; {p['weights_trials']}" if p.get("weights_trials") else ""
        lines.append(f"- `{mode}`: verify ms by proposals {{{costs}}}, drafter {p['draft_ms_per_token']:.1f} ms/token; "
                     f"drafting skipped in {plain} of {total} steps{chosen}{trials}")
    return "\n".join(lines) + ("\n" if lines else "")


def turn_table(summary: dict[str, dict], turns: list[int]) -> str:
    """Median speedup of each mode by turn of a multi-turn set (later turns repeat more of the chat)."""
    import statistics

    numbers = sorted(set(turns))
    lines = ["Speedup by turn (median over the chats):", "", "| mode | " + " | ".join(f"turn {t}" for t in numbers) + " |",
             "|---|" + "---|" * len(numbers)]
    for mode, row in summary.items():
        ratios = row.get("speedup_per_prompt") or []
        if len(ratios) != len(turns):
            continue
        cells = [statistics.median([r for r, t in zip(ratios, turns) if t == n]) for n in numbers]
        lines.append(f"| {mode} | " + " | ".join(f"{c:.2f}×" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(out_dir: Path, meta: dict, summary: dict[str, dict]) -> list[Path]:
    """results.json, results.md, speedup.png, time_split.png under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "results.json", json.dumps({"meta": meta, "modes": summary}, indent=1).encode())
    md = f"# omnidraft bench\n\n{meta_line(meta)}\n\n{markdown_table(summary)}"
    remote = {m: r["wire_bytes_per_token"] for m, r in summary.items() if r.get("wire_bytes_per_token")}
    if remote:
        md += "\nOver the wire (message bytes both ways per generated token; tokens/target fwd = tokens per round trip): " + \
              ", ".join(f"`{m}` {b:.0f} B" for m, b in remote.items()) + f" (injected round trip {meta.get('rtt_ms', 0):g} ms)\n"
    timely = {m: r["timely_forward_share"] for m, r in summary.items() if r.get("timely_forward_share")}
    if timely:
        md += "\nServer forwards that began with a usable draft (streaming verification; in brackets, those that " + \
              "verified a fork of the draft, a correction the device foresaw): " + \
              ", ".join(f"`{m}` {share:.0%} ({summary[m].get('forked_forward_share') or 0:.0%})" for m, share in timely.items()) + "\n"
        plain = {m: r["server_plain_step_ms"] for m, r in summary.items() if r.get("server_plain_step_ms")}
        if len(plain) > 1:
            md += "\nThe server's median plain step, as each mode saw it (where the device shares the server's host, " + \
                  "its drafting slows the server's steps): " + ", ".join(f"`{m}` {ms:.1f} ms" for m, ms in plain.items()) + "\n"
        waits = {m: summary[m].get("server_wait_s") or 0.0 for m in timely}
        if any(waits.values()):
            md += "\nSeconds the server waited for the device's next draft (after a correction, where a wait pays): " + \
                  ", ".join(f"`{m}` {s:.1f} s" for m, s in waits.items()) + "\n"
    if "target-sample" in summary:
        md += "\nThe sampling modes' speedups are against `target-sample`: the target alone, sampling at the same temperature.\n"
    if meta.get("turns"):
        md += "\n" + turn_table(summary, meta["turns"])
    if meta.get("policy"):
        md += "\nThe cost-aware draft policy (`--draft-stop auto`):\n\n" + policy_lines(meta["policy"])
    atomic_write(out_dir / "results.md", md.encode())
    return [out_dir / "results.json", out_dir / "results.md"] + plot(out_dir, summary)


def draft_policy(meta: dict) -> str:
    """How long drafts were: the policy changes what acceptance means, so every report names it."""
    k, stop, conf = meta.get("draft_len"), meta.get("draft_stop", "confidence"), meta.get("draft_confidence")
    if k is None:
        return "draft policy not recorded"
    if stop == "fixed" or (stop == "confidence" and not conf):
        return f"fixed k = {k}"
    head = f"acceptance head, γ = {meta.get('stop_gamma')}"
    if stop == "head":
        return f"k ≤ {k}, {head}"
    if stop == "auto":
        return f"k ≤ {k}, cost-aware (drafts only while expected to raise tokens/s)"
    return f"k ≤ {k}, confidence stop {conf}"


def drafter_runtime(meta: dict) -> str:
    """What ran the drafter in our modes: the pipeline's backend label ("native", "torch-bfloat16",
    "onnx-int8"; reports from before it was recorded say "auto" or "torch": the torch drafter)."""
    backend = meta.get("drafter_backend", "auto")
    if backend in ("auto", "torch"):
        return f"torch drafter in {meta['drafter_dtype']}"
    if backend.startswith("torch-"):
        return f"torch drafter in {backend.removeprefix('torch-')}"
    return f"drafter on {backend}"


def meta_line(meta: dict) -> str:
    return (f"drafter `{meta['drafter']}` → target `{meta['target']}`, prompts `{meta['prompts']}` × {meta['n']}, "
            f"{meta['max_new_tokens']} new tokens, {draft_policy(meta)}, "
            + drafter_runtime(meta) + " (the -onnx and -gguf modes: the export, the GGUF), "
            + (f"adapter {meta['adapter']}, " if meta.get("adapter", "none") != "none" else "") +
            f"sampling modes at T={meta['temperature_sampling_modes']}, "
            f"{meta['threads']} threads" + (f", CPU {meta['host']}" if meta.get("host") else ""))


def plot(out_dir: Path, summary: dict[str, dict]) -> list[Path]:
    """Speedup per mode (median, with per-prompt points) and the time split per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(summary)
    fig, ax = plt.subplots(figsize=(8, 4))
    med = [summary[m]["speedup_vs_target"] or 0 for m in modes]
    ax.bar(modes, med, color=["#999" if m.startswith(("target", "hf")) else "#3a7" for m in modes])
    for i, m in enumerate(modes):
        pts = summary[m]["speedup_per_prompt"]
        ax.scatter([i] * len(pts), pts, s=8, color="k", zorder=3)
    ax.axhline(1.0, color="r", lw=0.8, ls="--")
    ax.set_ylabel("speedup vs target alone (tokens/s ratio)")
    ax.set_title("median speedup per mode (dots: prompts)")
    fig.autofmt_xdate(rotation=30)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(modes)
    for part, color in (("draft", "#48c"), ("verify", "#c84"), ("bridge", "#8c4"), ("other", "#aaa")):
        vals = [summary[m]["time_split_s"][part] / max(summary[m]["new_tokens"], 1) * 1000 for m in modes]
        ax.bar(modes, vals, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per generated token")
    ax.set_title("where the time goes")
    ax.legend()
    fig.autofmt_xdate(rotation=30)
    fig.tight_layout()
    fig.savefig(out_dir / "time_split.png", dpi=110)
    plt.close(fig)
    return [out_dir / "speedup.png", out_dir / "time_split.png"]
