"""The GPU check's rows cannot pass or fail by the check's own mistake: each row's verdict, run on the CPU.

The memory row counts recaptures the way the runner really makes them (the CPU replay backend recaptures like a
CUDA graph), a kernel-count row that counted nothing fails, and the planted extra kernel is seen.
"""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))

import gpu_check_fsdp2 as fsdp2_part  # noqa: E402
import gpu_check_numerics as numerics  # noqa: E402
import gpu_check_speed as speed  # noqa: E402

CPU = torch.device("cpu")


def test_the_memory_row_counts_the_recaptures_the_runner_makes():
    [row] = numerics.part_memory(CPU, small=True)
    assert row["status"] == "skipped: no CUDA", row["detail"]  # not "fail": the count logic holds on the CPU
    assert row["numbers"]["recaptures"] == list(range(1, numerics.MEMORY_ROUNDS + 1))


def test_the_memory_verdict_fails_on_a_missing_recapture_or_grown_memory():
    rounds = list(range(1, 11))
    flat = [100 << 20] * 10
    assert numerics.memory_verdict("m", rounds, flat, flat, cuda=True)["status"] == "pass"
    assert numerics.memory_verdict("m", [1, 1, 2, 2, 3, 3, 4, 4, 5, 5], flat, flat, cuda=True)["status"] == "fail"
    grown = flat[:-1] + [flat[-1] + (2 << 20)]
    assert numerics.memory_verdict("m", rounds, flat, grown, cuda=True)["status"] == "fail"


@pytest.mark.parametrize("counts", [{150: 0.0, 1000: 0.0, 10000: 0.0}, {150: math.nan, 1000: math.nan, 10000: math.nan},
                                    {150: 12.0, 1000: 12.0, 10000: 13.0}])
def test_a_kernel_count_row_that_counted_nothing_or_differs_fails(counts):
    assert speed.kernel_count_verdict(counts, "test", 10 ** 6)["status"] == "fail"


def test_equal_nonzero_kernel_counts_pass():
    assert speed.kernel_count_verdict({150: 12.0, 1000: 12.0, 10000: 12.0}, "test", 10 ** 6)["status"] == "pass"


def test_the_planted_kernel_is_seen_on_the_cpu_replay_backend():
    row = speed.planted_kernel_control(CPU)
    assert row["status"] == "pass", row["detail"]
    assert row["numbers"]["planted"] == row["numbers"]["plain"] + 1


@pytest.mark.parametrize("plain, planted", [(0.0, 0.0), (0.0, 1.0), (3.0, 3.0), (3.0, 5.0), (math.nan, math.nan)])
def test_the_planted_kernel_control_fails_when_the_count_misses_it_or_counted_nothing(plain, planted):
    assert speed.planted_verdict(plain, planted, "test")["status"] == "fail"


def test_a_timer_that_recorded_nothing_is_named():
    assert speed.unmeasured({"captured": 0.0, "flat": 1.5, "eager": math.nan}) == ["captured", "eager"]
    assert speed.unmeasured({"captured": 0.2}) == []


def test_a_broken_fsdp2_iteration_row_keeps_the_step_row(monkeypatch):
    # The iteration row runs second in the FSDP2 part: if it raises (a CUDA capture FSDP2 cannot take), the
    # step row's verdict is kept and the iteration row says "error" (the runner then starts a fresh worker).
    def verdict(name, device, steps, whole_iteration):
        if whole_iteration:
            raise RuntimeError("planted")
        return numerics.record(name, "pass", "planted")

    monkeypatch.setattr(fsdp2_part, "_verdict", verdict)
    step, iteration = fsdp2_part.part_fsdp2(CPU, small=True)
    assert (step["check"], step["status"]) == (fsdp2_part.NAME, "pass")
    assert (iteration["check"], iteration["status"]) == (fsdp2_part.ITERATION_NAME, "error")
    assert "planted" in iteration["detail"]
