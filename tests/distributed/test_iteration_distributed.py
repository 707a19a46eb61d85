"""graphstep.Iteration on 2 gloo ranks, with DDP, with the distributed optimizer, with FSDP2 (fp32, and computing in
bf16 with the blocks kept gathered between forward and backward) and with tensor parallelism (a Megatron-split
MLP): the captured iteration (DDP's all-reduce, the optimizer's reduce-scatter and all-gather, FSDP2's
all-gathers into memory it allocates and frees and its reduce-scatters, the forward's tensor-parallel
all-reduce, replayed inside it) equals the eager one and the user's opt.step() loop bitwise on every rank, the
ranks agree, and a non-finite grad on one rank skips the step on both; a state dict loaded into the model in
place mid-run is trained on alike. One spawn runs every scenario."""

import pytest
import torch

import _iteration_workers
from _harness import spawn, values

pytestmark = pytest.mark.distributed

SCENARIOS = ("ddp", "distributed_optimizer", "fsdp2", "fsdp2_bf16_compute", "tensor_parallel")


@pytest.fixture(scope="module")
def ranks():
    return values(spawn(_iteration_workers.scenarios, 2, timeout=150))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_captured_iteration_equals_eager_and_the_users_loop_bitwise(ranks, scenario):
    for report in ranks:
        runs = report[scenario]
        graph = runs["graph"]
        assert graph["captured"] and graph["recaptures"] == 0 and graph["replays"] == _iteration_workers.ITERATIONS - 3
        if scenario != "tensor_parallel":  # a state dict loaded in place mid-run: in the model, then trained on
            for kind in ("graph", "eager", "loop"):
                from_snapshot, from_replaced = runs[kind]["moved"]  # one step after the load (undone: the reverse)
                assert runs[kind]["loaded"] and from_snapshot < from_replaced / 2, (kind, from_snapshot, from_replaced)
        for other in ("eager", "loop"):
            for step, (a, b) in enumerate(zip(graph["records"], runs[other]["records"])):
                for field, x, y in zip(("loss", "grad_norm", "update", "scale", "skipped"), a, b):
                    assert torch.equal(x, y), f"{scenario}: iteration {step}: {field} differs from {other}"
            assert all(torch.equal(a, b) for a, b in zip(graph["params"], runs[other]["params"]))
            if scenario != "tensor_parallel":
                assert all(torch.equal(a, b) for a, b in zip(graph["evaluations"], runs[other]["evaluations"]))
        if scenario != "tensor_parallel":
            assert graph["evaluation_replays"] == _iteration_workers.EVALUATIONS - 3


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_ranks_agree_and_skip_together(ranks, scenario):
    rank0, rank1 = (report[scenario]["graph"] for report in ranks)
    if scenario in ("ddp", "distributed_optimizer"):  # FSDP2 and tensor parallelism: each rank its own slices
        assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"]))
    for step in _iteration_workers.POISONED:  # poisoned on rank 0 alone
        assert not bool(rank0["records"][step][2]) and not bool(rank1["records"][step][2])
    assert sum(bool(r[2]) for r in rank1["records"]) >= _iteration_workers.ITERATIONS - 3
