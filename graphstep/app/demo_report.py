"""What ``graphstep demo`` prints and draws at the end: the summary table, the eager-versus-captured
comparison and the loss-curve PNG (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from .demo import RunResult


def summary_table(results: Sequence[RunResult], last: int) -> str:
    """One row per run: final loss (mean of the last ``last`` steps), median ms/step, skipped steps,
    what ran the step, and the loss scale at the end (fp16)."""
    header = ("run", "backend", "final loss", "last step loss", "median ms/step", "skipped", "loss scale")
    rows = [(r.label, r.backend, f"{r.final_loss(last):.4f}", f"{float(r.losses[-1]):.9g}",
             f"{r.median_ms:.1f}", str(r.skipped), "-" if r.loss_scale is None else f"{r.loss_scale:g}")
            for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(row) for row in rows])


def compare(results: Sequence[RunResult]) -> Optional[tuple[bool, str]]:
    """(equal, message) for an eager and a captured run of the same training; None for a single run.
    Equal means bitwise: every step's loss and the final params, not just close."""
    if len(results) < 2:
        return None
    a, b = results[0], results[1]
    # bytes, not ==: a NaN in both runs at the same step is the same result, and -0.0 != 0.0 bitwise
    losses_equal = a.losses.numpy().tobytes() == b.losses.numpy().tobytes()
    params_equal = a.params_sha256 == b.params_sha256
    equal = losses_equal and params_equal
    final_a, final_b = float(a.losses[-1]), float(b.losses[-1])
    if equal:
        return True, (f"{a.label} vs {b.label} ({b.backend}): final losses equal, bitwise "
                      f"({final_a!r} == {final_b!r}); all {a.losses.numel()} step losses and the final params "
                      f"are bitwise equal")
    first = next((i for i in range(min(a.losses.numel(), b.losses.numel()))
                  if a.losses[i].item() != b.losses[i].item()), None)
    where = f"first difference at step {first + 1}" if first is not None else "losses equal"
    return False, (f"{a.label} vs {b.label} ({b.backend}): NOT equal: final losses {final_a!r} vs {final_b!r}, "
                   f"{where}, params {'equal' if params_equal else 'differ'}")


def plot_losses(results: Sequence[RunResult], path: Path, title: str, floor: Optional[float] = None) -> Path:
    """Both runs' per-step losses on one plot (the captured run dashed over the eager one)."""
    try:
        import matplotlib  # the app extra: imported here only, so the rest of the app runs without it
    except ImportError:
        raise ImportError("the loss-curve PNG needs matplotlib: pip install 'graphstep[app]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    styles = [dict(color="tab:blue", linewidth=2.4, alpha=0.75), dict(color="tab:orange", linewidth=1.2,
                                                                         linestyle="--")]
    for result, style in zip(results, styles * len(results)):
        steps = range(1, result.losses.numel() + 1)
        ax.plot(steps, result.losses.tolist(), label=f"{result.label} (step ran {result.backend}, "
                f"{result.median_ms:.1f} ms/step)", **style)
    if floor is not None:
        ax.axhline(floor, color="gray", linewidth=0.8, linestyle=":", label=f"corpus entropy rate {floor:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
