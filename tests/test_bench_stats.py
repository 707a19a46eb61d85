"""``graphstep bench``'s ratio intervals: the bootstrap over interleaved rounds, and the key-ratio table."""

import json
import random
import statistics

import pytest

from graphstep.app import bench
from graphstep.app.bench_stats import ratio_interval


def noisy_times(rounds: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [50.0 * rng.uniform(0.7, 1.6) for _ in range(rounds)]  # a shared machine: tens of percent


def test_a_slow_round_on_both_rows_does_not_widen_the_interval():
    # Every round is slow or fast for both rows alike (the point of interleaving): resampling whole
    # rounds keeps each pair together, so the ratio is exact in every resample.
    floor = noisy_times(40, seed=1)
    step = [1.1 * t for t in floor]
    ratio, low, high = ratio_interval(step, floor)
    assert ratio == pytest.approx(1.1)
    assert low == pytest.approx(1.1) and high == pytest.approx(1.1)


def test_independent_noise_gives_an_interval_around_the_ratio_that_narrows_with_rounds():
    short = ratio_interval(noisy_times(40, seed=2), noisy_times(40, seed=3))
    long = ratio_interval(noisy_times(400, seed=2), noisy_times(400, seed=3))
    for ratio, low, high in (short, long):
        assert low <= ratio <= high
        assert low < high
    assert long[2] - long[1] < (short[2] - short[1]) / 2


def test_the_interval_is_deterministic_for_a_seed_and_refuses_unpaired_lists():
    a, b = noisy_times(30, seed=4), noisy_times(30, seed=5)
    assert ratio_interval(a, b) == ratio_interval(a, b)
    assert ratio_interval(a, b, seed=1) != ratio_interval(a, b, seed=2)
    with pytest.raises(ValueError, match="same rounds"):
        ratio_interval(a, b[:-1])
    with pytest.raises(ValueError, match="same rounds"):
        ratio_interval([], [])


def test_an_interleaved_run_reports_the_key_ratios_with_intervals(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--interleave", "--steps", "4", "--warmup", "1", "--json", str(out),
                       "--only", "fused-floor,graphstep-scaled-folded,torch-amp"]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    paired = {(r["numerator"], r["denominator"]): r for r in result["key_ratios"]}
    assert set(paired) == {("graphstep-scaled-folded", "fused-floor"), ("torch-amp", "graphstep-scaled-folded")}
    times = {row["key"]: row["times_ms"] for row in result["rows"]}
    step = paired[("graphstep-scaled-folded", "fused-floor")]
    assert step["ratio"] == pytest.approx(statistics.median(times["graphstep-scaled-folded"]) /
                                          statistics.median(times["fused-floor"]))
    assert step["low"] <= step["ratio"] <= step["high"]
    assert "| default step with loss scale / `_fused_adamw_` floor |" in table
    assert "95% interval" in table


def test_a_run_without_interleaving_has_no_paired_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--steps", "2", "--warmup", "0", "--json", str(out),
                       "--only", "fused-floor,graphstep-scaled-folded"]) == 0
    assert "95% interval" not in capsys.readouterr().out
    assert json.loads(out.read_text())["key_ratios"] == []
