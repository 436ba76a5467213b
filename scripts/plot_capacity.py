"""docs/remote-capacity.png: aggregate tokens/s by client count, a server that runs one session per
forward against `serve --batch`, on the GPU and on this CPU, from the `experiment capacity` tables
kept under docs/bench/ (thin clients, no drafting).

    python scripts/plot_capacity.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"
# (title, [(folder, table, label)]): the GPU panel keeps the first batching run beside the later one
PANELS = (("NVIDIA H100, Qwen2.5-Coder-0.5B bf16",
           [("2026-11-27-gpu-batch", "capacity-one.md", "one session per forward"),
            ("2026-11-27-gpu-batch", "capacity-batch.md", "--batch, every forward the 8-session size (first run)"),
            ("2026-11-27-gpu-batch-sizes", "capacity-batch.md", "--batch, checked sizes, argmax on the GPU")]),
          ("2 cores of an AMD EPYC, Qwen2.5-Coder-0.5B fp32",
           [("2026-11-27-cpu-batch", "capacity-one.md", "one session per forward"),
            ("2026-11-27-cpu-batch", "capacity-batch.md", "--batch")]))


def rows(path: Path) -> list[tuple[int, float]]:
    """(clients, aggregate tok/s) of the rows without drafting."""
    out = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 4 and cells[0].isdigit() and cells[1] == "no":
            out.append((int(cells[0]), float(cells[4])))
    return out


def main() -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (title, series) in zip(axes, PANELS):
        for folder, name, label in series:
            points = rows(BENCH / folder / name)
            ax.plot([c for c, _ in points], [t for _, t in points], marker="o", label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("clients (thin: the server decodes, no drafting)")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_xticks([1, 2, 4, 8])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(__file__).resolve().parents[1] / "docs" / "remote-capacity.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
