"""PNG plots of perf/harness.py's rows (matplotlib, Agg): step time versus parameter count on one flat
tensor, and versus tensor count at a fixed total size. Log axes: sizes and times span decades."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"graphstep-captured": ("graphstep captured (32 B/param)", "C0", "o"),
         "graphstep-eager": ("graphstep eager (32 B/param)", "C2", "s"),
         "torch-fused": ("torch GradScaler + clip + AdamW(fused) (48 B/param)", "C3", "^")}


def _series(rows, shapes, pipeline, x_of):
    points = sorted((x_of(r), r["median_ms"]) for r in rows
                    if r["shape"] in shapes and r["pipeline"] == pipeline and "median_ms" in r)
    return [p[0] for p in points], [p[1] for p in points]


def plot_param_count(rows, bandwidth_gbps: float, path: Path) -> Path:
    """ms/step versus params on one flat tensor, with the bandwidth floors of both byte models."""
    shapes = {r["shape"] for r in rows if r["shape"].startswith("flat")}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for pipeline in ("graphstep-captured", "torch-fused"):
        label, color, marker = STYLE[pipeline]
        xs, ys = _series(rows, shapes, pipeline, lambda r: r["numel"])
        ax.plot(xs, ys, marker=marker, color=color, label=label)
    sizes = sorted({r["numel"] for r in rows if r["shape"] in shapes})
    for nbytes, style in ((32, ":"), (48, "--")):
        ax.plot(sizes, [nbytes * n / (bandwidth_gbps * 1e9) * 1e3 for n in sizes], style, color="gray",
                label=f"floor: {nbytes} B/param at {bandwidth_gbps:.1f} GB/s")
    return _finish(fig, ax, path, xlabel="parameters (one flat fp32 tensor)",
                   title="Optimizer step time versus parameter count")


def plot_tensor_count(rows, path: Path) -> Path:
    """ms/step versus the number of tensors the same total params are split into."""
    shapes = {r["shape"] for r in rows if r["shape"].startswith("tensors-")}
    total = next((r["numel"] for r in rows if r["shape"] in shapes), 0)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for pipeline in ("graphstep-captured", "graphstep-eager", "torch-fused"):
        label, color, marker = STYLE[pipeline]
        xs, ys = _series(rows, shapes, pipeline, lambda r: r["tensors"])
        ax.plot(xs, ys, marker=marker, color=color, label=label)
    return _finish(fig, ax, path, xlabel="tensors (fixed total)",
                   title=f"Optimizer step time versus tensor count (~{total / 1e6:.1f}M fp32 params in all)")


def _finish(fig, ax, path: Path, *, xlabel: str, title: str) -> Path:
    """Log-log axes, grid and legend as both plots have them; save and close."""
    ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="ms / step (median)", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(rows, bandwidth_gbps: float, out: Path) -> list[Path]:
    """Both plots under ``out``; a plot with no rows is skipped."""
    written = []
    if any(r["shape"].startswith("flat") and "median_ms" in r for r in rows):
        written.append(plot_param_count(rows, bandwidth_gbps, out / "step_vs_params.png"))
    if any(r["shape"].startswith("tensors-") and "median_ms" in r for r in rows):
        written.append(plot_tensor_count(rows, out / "step_vs_tensors.png"))
    return written
