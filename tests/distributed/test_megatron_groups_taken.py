"""A Megatron-Core model built with ``get_optimizer`` and no groups (graphstep/plan/megatron_groups.py): its
groups are taken from an initialised ``parallel_state`` (and said so), refused by name without one, and its
tensor-parallel marks must agree across the TP ranks (graphstep/plan/model_parallel.py); against the unsplit
model in one process."""

import pytest

import _megatron_group_workers
from _harness import spawn, values

pytestmark = pytest.mark.distributed
pytest.importorskip("megatron.core", reason="megatron-core is not installed (the test extra)")


@pytest.fixture(scope="module")
def ranks():
    """Both ranks' reports: every case runs in one spawn (each rank imports Megatron-Core once)."""
    return values(spawn(_megatron_group_workers.cases, 2, timeout=240))


@pytest.mark.parametrize("run", ["replicated", "captured", "distributed", "experts"])
def test_groups_are_taken_from_megatrons_parallel_state_and_the_norm_is_the_unsplit_models(ranks, run):
    # Before: built with per-rank norms (each rank counted only its own slices and its replicated params), and
    # with the distributed optimizer the TP ranks were taken for data-parallel ones (WORLD).
    for found in ranks:
        report = found["runs"][run]
        assert report["captured"] == (run == "captured")
        assert report["norms"] == pytest.approx(report["expected"], rel=1e-5), report
        assert report["worst_param_error"] < 1e-5, report
        (said,) = report["said"]  # once, naming the groups it took
        assert "tensor_parallel_group (ranks [0, 1])" in said and "model_parallel_group" in said, said
        assert ("process_group" in said) == (run in ("distributed", "experts")), said
        assert ("expert_tensor_parallel_group (ranks [0, 1])" in said) == (run == "experts"), said
        assert ("expert_data_parallel_group" in said) == (run == "experts"), said


def test_marked_params_without_groups_or_parallel_state_are_refused_naming_the_argument(ranks):
    for found in ranks:
        message = found["no_groups_no_parallel_state"]
        assert "tensor_parallel_group" in message and "up.weight" in message, message
        assert "parallel_state" in message, message
        # some groups given under an initialised parallel_state: not completed from it, refused the same way
        assert "tensor_parallel_group" in found["partly_given"], found["partly_given"]


@pytest.mark.parametrize("case", ["partition_dim", "unmarked"])
def test_marks_that_differ_across_tensor_parallel_ranks_are_refused_by_param_name(ranks, case):
    # Before: built silently, each rank counting the param by its own marks.
    name = {"partition_dim": "down.weight", "unmarked": "up.bias"}[case]
    for found in ranks:
        message = found[f"marks_differ_{case}"]
        assert f"'{name}'" in message and "tensor-parallel ranks" in message, message
        assert found["same_marks"] == "built", found["same_marks"]
