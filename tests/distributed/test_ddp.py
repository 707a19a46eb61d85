"""graphstep beside DistributedDataParallel on 2 gloo ranks (graphstep/hooks/ddp.py): DDP with the plain optimizer
tracks a single-process run on the global batch, with the norm folded once per step (not in backward and
again after DDP rewrote the grads); ranks with neither DDP nor the distributed optimizer are warned; DDP with
the distributed optimizer (grads averaged twice) is refused. One spawn runs every scenario."""

import pytest
import torch

from _harness import relative_drift, spawn, values
import _ddp_workers

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks():
    return values(spawn(_ddp_workers.scenarios, 2, timeout=120))


@pytest.mark.parametrize("order", ["ddp_first", "optimizer_first"])
def test_ddp_tracks_the_single_process_run(ranks, order):
    for report in ranks:
        run = report[order]
        assert run["captured"]
        # Two half-batch grads averaged versus one full batch: Adam in fp32, 2e-4 of the motion (docs/design.md §8).
        assert relative_drift(run["params"], report["reference"], report["start"]) < 1e-3
        assert not run["warnings"], run["warnings"]
    for a, b in zip(ranks[0][order]["params"], ranks[1][order]["params"]):
        assert (a == b).all()  # the ranks agree bitwise


@pytest.mark.parametrize("order", ["ddp_first", "optimizer_first"])
def test_under_ddp_each_grad_is_folded_once_per_step(ranks, order):
    # DDP writes the averaged grads after backward's hooks: a fold there would be refolded before the step.
    for report in ranks:
        run = report[order]
        assert run["units"] > 0
        assert run["folds"] == {"in_backward": 0, "before_step": run["units"] * _ddp_workers.STEPS}


def test_ddp_with_grads_as_bucket_views_trains_bitwise_like_the_default(ranks):
    # DDP re-points each .grad at its bucket after the all-reduce; the step adopts the values back into
    # graphstep's grad buffer (StaticBuffers.bind_grads) before it reads them: nothing is lost or stale.
    for report in ranks:
        assert report["bucket_view"]["captured"] and not report["bucket_view"]["warnings"]
        for a, b in zip(report["bucket_view"]["params"], report["ddp_first"]["params"]):
            assert torch.equal(a, b)


def test_ranks_without_ddp_or_the_distributed_optimizer_are_warned_once(ranks):
    for report in ranks:
        assert len(report["alone_warnings"]) == 1
        assert "ranks train apart" in report["alone_warnings"][0]


def test_ddp_with_the_distributed_optimizer_is_refused(ranks):
    for report in ranks:
        for where in ("refused_at_build", "refused_at_forward"):
            assert report[where] is not None and "average them twice" in report[where], where
