"""Failure behaviour: a dead or silent peer makes the survivors raise a CollectiveError naming the
collective within ``distributed_timeout_s`` (never a hang); ranks that planned different layouts or use
different configs are told so at build, before any step."""

import pytest

from _harness import spawn, values
import _workers

pytestmark = pytest.mark.distributed

TIMEOUT_S = 3.0


@pytest.mark.parametrize("world_size", [2, 3])
def test_killed_rank_makes_survivors_fail_with_a_clear_error_fast(world_size):
    results = spawn(_workers.failing_peer, world_size, "kill", TIMEOUT_S, timeout=45,
                    allow_missing=(world_size - 1,))
    assert results[-1] is None  # the killed rank reported nothing
    for rank, report in enumerate(values(results[:-1])):
        assert report["step"] == 3, report
        assert report["elapsed"] < TIMEOUT_S + 2.0, report  # a dead peer's sockets close: no need to wait
        assert "grad reduce-scatter of bucket" in report["what"], report
        assert "data-parallel group" in report["error"] and "closed its connection" in report["error"], report


def test_killed_rank_fails_the_captured_step_with_a_clear_error_fast():
    results = spawn(_workers.failing_peer, 2, "kill", TIMEOUT_S, "graph", timeout=45, allow_missing=(1,))
    report = values(results[:1])[0]
    assert report["step"] == 3 and report["captured"], report
    assert report["elapsed"] < TIMEOUT_S + 2.0, report
    assert "captured step" in report["what"] and "grad reduce-scatter of bucket" in report["what"], report


def test_silent_rank_makes_the_other_fail_within_the_timeout():
    results = spawn(_workers.failing_peer, 2, "hang", TIMEOUT_S, timeout=45, allow_missing=(1,))
    report = values(results[:1])[0]
    assert report["step"] == 3, report
    assert TIMEOUT_S - 0.5 < report["elapsed"] < TIMEOUT_S + 3.0, report
    assert "grad reduce-scatter of bucket" in report["what"]
    assert "did not answer within distributed_timeout_s=3" in report["error"], report["error"]


def test_layout_or_config_that_differs_between_ranks_is_refused_at_build():
    errors = values(spawn(_workers.mismatch, 2, timeout=45))
    for rank, found in enumerate(errors):
        other = 1 - rank
        assert found["model"] is not None and "lay out param" in found["model"], found
        assert f"rank {other}" in found["model"] and "shape" in found["model"]
        assert found["config"] is not None and "OptimizerConfig.lr" in found["config"], found
        assert "0.05" in found["config"] and "0.1" in found["config"]
        # the layout check's object exchange runs on a gloo group of its own, never on the step's group
        assert found["object_exchanges"], found
        assert all(x["backend"] == "gloo" and not x["step_group"] for x in found["object_exchanges"]), found


def test_destroying_the_process_group_releases_the_captured_step_first():
    # NCCL >= 2.26 waits, in destroy, for every CUDA graph holding the communicator's collectives: a
    # captured step must be gone before the groups are, even when the user never closed the optimizer.
    for report in values(spawn(_workers.teardown_after_capture, 2, timeout=45)):
        assert report == {"captured_before": True, "captured_after": False}, report
