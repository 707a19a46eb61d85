"""perf/gpu_check_iteration.py, the GPU check's whole-iteration part, on its CPU path: the bitwise row passes over
the replay backend (training, evaluations, training), the time row is reported for reference, and each verdict can
fail: a planted difference, a timer that measured nothing, a captured iteration slower than eager on a GPU."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))

import gpu_check_iteration as iteration_part  # noqa: E402
import gpu_check_parts  # noqa: E402

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: the tiny model runs on one thread


def test_the_part_runs_on_the_cpu_path():
    bitwise, timed = iteration_part.part_iteration(CPU, small=True)
    assert bitwise["check"] == iteration_part.BITWISE and bitwise["status"] == "pass", bitwise["detail"]
    assert "captured (replay) vs eager" in bitwise["detail"]
    assert timed["check"] == iteration_part.TIME and timed["status"] == "skipped: no CUDA", timed["detail"]
    assert timed["numbers"]["eager_ms"] > 0 and timed["numbers"]["captured_ms"] > 0


def test_a_planted_difference_is_seen():
    a = [torch.tensor([1.0, 2.0]), torch.tensor(0.0)]
    b = [torch.tensor([1.0, 2.0]), torch.tensor(-0.0)]  # equal as numbers, not as bits
    assert iteration_part.differing(a, a) == []
    assert iteration_part.differing(a, b) == [1]
    failed = iteration_part.bitwise_verdict([1], [], 2, "cuda")
    assert failed["status"] == "fail" and "the capture changed the result" in failed["detail"]
    assert "not deterministic" in iteration_part.bitwise_verdict([1], [1], 2, "cuda")["detail"]


@pytest.mark.parametrize("eager, captured, status", [(10.0, 4.0, "pass"), (10.0, 12.0, "fail"), (0.0, 4.0, "fail"),
                                                     (math.nan, 4.0, "fail")])
def test_the_time_verdict_on_a_gpu(eager, captured, status):
    assert iteration_part.time_verdict(eager, captured, cuda=True)["status"] == status


def test_the_part_is_listed_with_its_rows_within_the_budget():
    part = gpu_check_parts.BY_NAME["iteration"]
    assert part.checks == (iteration_part.BITWISE, iteration_part.TIME) and part.cpu_ok
    assert gpu_check_parts.budget_problem() == ""
