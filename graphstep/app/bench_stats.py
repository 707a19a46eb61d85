"""Statistics over a benchmark's per-step timings (ms lists): percentiles, the median summary of a row, and
the bootstrap interval of a ratio between two rows timed in the same interleaved rounds. Pure Python over
the times ``bench_core``'s timers return; shared by ``graphstep bench``, perf/harness.py,
perf/bench_capture.py and the GPU check."""

from __future__ import annotations

import random
import statistics


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile of already sorted values (nearest rank below)."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def summarize(times: list[float]) -> dict:
    """Median, p10 and p90 of a list of ms timings."""
    ordered = sorted(times)
    return {"median_ms": statistics.median(times), "p10_ms": percentile(ordered, 0.1),
            "p90_ms": percentile(ordered, 0.9)}


def ratio_interval(numerator: list[float], denominator: list[float], *, level: float = 0.95,
                   resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The ratio of the medians of two rows timed in the same interleaved rounds, and its ``level``
    bootstrap interval: rounds resampled with replacement, each resample taking both rows' times of the
    same rounds (so a round's slow phase stays on both sides of the ratio). Deterministic for a seed.

    Why: on a shared machine single steps vary by tens of percent, so one run's ratio of medians moves by
    several percent from run to run; the interval says how far this run's figure can be trusted."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("ratio_interval needs two equally long, non-empty lists of times from the same rounds")
    rounds = len(numerator)
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        picked = [rng.randrange(rounds) for _ in range(rounds)]
        ratios.append(statistics.median([numerator[i] for i in picked]) /
                      statistics.median([denominator[i] for i in picked]))
    ratios.sort()
    tail = (1.0 - level) / 2
    return (statistics.median(numerator) / statistics.median(denominator),
            percentile(ratios, tail), percentile(ratios, 1.0 - tail))
