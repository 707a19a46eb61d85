"""graphstep.Iteration on 2 gloo ranks, with DDP, with the distributed optimizer and with tensor parallelism (a
Megatron-split MLP): the captured iteration (DDP's all-reduce, the optimizer's reduce-scatter and all-gather, the
forward's tensor-parallel all-reduce, replayed inside it) equals the eager one
and the user's opt.step() loop bitwise on every rank, the ranks agree, and a non-finite grad on one rank skips
the step on both. FSDP2: the eager iteration equals the user's loop; its capture is refused, saying why. One spawn
runs every scenario."""

import pytest
import torch

import _iteration_workers
from _harness import spawn, values

pytestmark = pytest.mark.distributed

SCENARIOS = ("ddp", "distributed_optimizer", "tensor_parallel")


@pytest.fixture(scope="module")
def ranks():
    return values(spawn(_iteration_workers.scenarios, 2, timeout=150))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_captured_iteration_equals_eager_and_the_users_loop_bitwise(ranks, scenario):
    for report in ranks:
        runs = report[scenario]
        graph = runs["graph"]
        assert graph["captured"] and graph["recaptures"] == 0 and graph["replays"] == _iteration_workers.ITERATIONS - 3
        for other in ("eager", "loop"):
            for step, (a, b) in enumerate(zip(graph["records"], runs[other]["records"])):
                for field, x, y in zip(("loss", "grad_norm", "update", "scale", "skipped"), a, b):
                    assert torch.equal(x, y), f"{scenario}: iteration {step}: {field} differs from {other}"
            assert all(torch.equal(a, b) for a, b in zip(graph["params"], runs[other]["params"]))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_ranks_agree_and_skip_together(ranks, scenario):
    rank0, rank1 = (report[scenario]["graph"] for report in ranks)
    if scenario != "tensor_parallel":  # tensor parallelism: each rank holds its own slices
        assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"]))
    for step in _iteration_workers.POISONED:  # poisoned on rank 0 alone
        assert not bool(rank0["records"][step][2]) and not bool(rank1["records"][step][2])
    assert sum(bool(r[2]) for r in rank1["records"]) >= _iteration_workers.ITERATIONS - 3


def test_fsdp2_eager_iteration_equals_the_users_loop_and_its_capture_is_refused(ranks):
    for report in ranks:
        runs = report["fsdp2"]
        for step, (a, b) in enumerate(zip(runs["eager"]["records"], runs["loop"]["records"])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"fsdp2: iteration {step} differs from the loop"
        assert all(torch.equal(a, b) for a, b in zip(runs["eager"]["params"], runs["loop"]["params"]))
        assert "FSDP2 (fully_shard) model cannot be captured yet" in report["fsdp2_capture_refused"]
