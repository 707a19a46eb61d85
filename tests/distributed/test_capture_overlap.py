"""The sharded step captured (the replay backend replays the gloo collectives) against eager, and the
overlap hooks against the plain step: same arithmetic, so bitwise equal."""

import pytest
import torch

from _harness import spawn, values
import _workers

pytestmark = pytest.mark.distributed


def test_captured_sharded_step_is_bitwise_equal_to_eager_on_2_ranks():
    results = values(spawn(_workers.capture_vs_eager, 2, timeout=55))
    for rank, result in enumerate(results):
        assert result["graph"]["captured"], "capture='graph' did not capture the step"
        assert result["graph"]["ok"] == result["eager"]["ok"]
        assert result["eager"]["ok"][6] is False and sum(result["eager"]["ok"]) == 9
        for a, b in zip(result["graph"]["params"], result["eager"]["params"]):
            assert torch.equal(a, b), f"rank {rank}: replayed step differs from eager"
    for a, b in zip(results[1]["graph"]["params"], results[0]["graph"]["params"]):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def overlap_runs():
    return values(spawn(_workers.overlap, 2, timeout=55))


@pytest.mark.parametrize("plain,overlapped", [("plain", "overlap"), ("plain_accum", "overlap_accum")])
def test_overlapped_grad_reduce_and_param_gather_are_bitwise_equal_to_the_plain_step(overlap_runs, plain,
                                                                                     overlapped):
    for rank, result in enumerate(overlap_runs):
        assert result[overlapped]["ok"] == result[plain]["ok"]
        for a, b in zip(result[overlapped]["params"], result[plain]["params"]):
            assert torch.equal(a, b), f"rank {rank}: {overlapped} differs from {plain}"


def test_overlap_hooks_launched_every_bucket_and_forward_waited_the_gathers(overlap_runs):
    for result in overlap_runs:
        launched, waited = result["overlap"]["overlap"]
        assert launched == 8 * result["overlap"]["num_buckets"]  # every bucket of every step, from backward
        assert waited > 0  # the next forward, not the step, finished the deferred all-gathers
        assert result["plain"]["overlap"] == (0, 0)
        launched_accum, _ = result["overlap_accum"]["overlap"]
        assert launched_accum == 8 * result["overlap"]["num_buckets"]  # no_sync: only the last micro-batch


def test_a_dropped_optimizer_frees_its_buffers_and_leaves_no_hook_on_the_model():
    # The overlap hooks (and the folded norm's) reach the optimizer weakly: dropping it frees its buffers
    # and removes its hooks, so a later backward launches no collective.
    for result in values(spawn(_workers.dropped_optimizer, 2, timeout=55)):
        assert result["launched"] > 0
        assert result["freed"] and result["hooks_left"] == 0


def test_a_rank_local_recapture_makes_every_rank_recapture_at_the_same_step():
    # A captured collective must be replayed by every rank from the same capture: rank 1 alone replaces a
    # param, and both ranks recapture at that step (graphstep/parallel/agreement.py), staying equal to eager.
    results = values(spawn(_workers.one_rank_replaces_a_param, 2, timeout=55))
    for rank, result in enumerate(results):
        assert result["graph"]["captured"]
        assert result["graph"]["recaptured_at"] == [5], f"rank {rank}"
        assert result["eager"]["recaptured_at"] == []
        for a, b in zip(result["graph"]["params"], result["eager"]["params"]):
            assert torch.equal(a, b), f"rank {rank}: replayed step differs from eager"
