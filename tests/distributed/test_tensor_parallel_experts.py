"""Tensor parallelism with MoE experts: each expert grad element counted once in the norm, the clip and
num_zeros whether the experts are split over the TP ranks or spread over them (graphstep/plan/model_parallel.py),
against the whole model in one process."""

import pytest

import _tp_expert_workers
from _harness import spawn, values
from _tp_workers import LONG_STEPS, NAN_STEP

pytestmark = pytest.mark.distributed


CASES = ((2, "adam"), (1, "adam"), (2, "muon"))


@pytest.fixture(scope="module")
def reports():
    """Every case on one set of 4 ranks: [{case: report}] per rank."""
    return values(spawn(_tp_expert_workers.cases, 4, CASES, timeout=150))


@pytest.mark.parametrize("expert_tp, optimizer", CASES)
def test_experts_under_tensor_times_data_parallel_equal_the_whole_model(reports, expert_tp, optimizer):
    # With expert TP = 2 each expert's down bias is replicated over the TP pair and must count once; with
    # expert TP = 1 the TP pair holds different experts and both must count theirs. The NaN on rank 3 sits in a
    # param that rank does not count (expert TP = 2) and still skips the step on all four ranks.
    skipped = [step == NAN_STEP for step in range(LONG_STEPS)]
    for report in (by_case[(expert_tp, optimizer)] for by_case in reports):
        expected = report["expected"]
        assert [not applied for applied, _, _ in expected] == skipped
        for capture, run in report["runs"].items():
            assert run["captured"] == (capture == "graph")
            found = run["found"]
            assert [a for a, _, _ in found] == [a for a, _, _ in expected], (capture, found)
            kept = [i for i in range(LONG_STEPS) if i != NAN_STEP]
            assert [found[i][1] for i in kept] == pytest.approx([expected[i][1] for i in kept], rel=1e-5), report
            assert [found[i][2] for i in kept] == [expected[i][2] for i in kept], report
            assert report["worst_param_error"][capture] < 1e-5, report
        assert report["captured_equals_eager"], report
        by_dense_rank = report["first_norm_by_dense_tp_rank"]
        if expert_tp == 2:  # the two readings agree when the groups coincide
            assert by_dense_rank == pytest.approx(expected[0][1], rel=1e-5), report
        else:  # expert 1's down bias left out
            assert by_dense_rank < expected[0][1] * (1 - 1e-4), report
