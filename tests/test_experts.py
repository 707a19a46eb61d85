"""Expert params on one process (graphstep/plan/experts.py): how they are recognised, that they join the dense
layout when there is nothing to shard or average, and the refusals that need no other rank. The 4-rank
runs against a single process live in tests/distributed/test_expert_parallel.py."""

import pytest
import torch

import graphstep as gs
from graphstep.plan.experts import is_expert_param


def _moe(mark: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    if mark:
        model[2].weight.allreduce = False
        model[2].bias.is_expert_parallel = True
    return model


def test_megatron_marks_make_an_expert_param():
    p = torch.nn.Parameter(torch.zeros(2))
    assert not is_expert_param(p)
    p.allreduce = True
    assert not is_expert_param(p)
    p.allreduce = False
    assert is_expert_param(p)
    q = torch.nn.Parameter(torch.zeros(2))
    q.is_expert_parallel = True
    assert is_expert_param(q)


@pytest.mark.parametrize("capture", ["eager", "graph"])
def test_on_one_process_expert_params_join_the_dense_layout_bitwise(capture):
    config = gs.OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.1, capture=capture, capture_warmup_steps=1)
    runs = []
    for mark in (False, True):
        model = _moe(mark)
        opt = gs.get_optimizer(config, model)
        assert opt.experts is None and len(opt.layout.params) == 6
        norms = []
        for step in range(5):
            opt.zero_grad()
            g = torch.Generator().manual_seed(step)
            loss = (model(torch.randn(4, 6, generator=g)) - torch.randn(4, 1, generator=g)).square().mean()
            loss.backward()
            norms.append(opt.step().grad_norm.clone())
        runs.append(([p.detach().clone() for p in model.parameters()], norms))
    (params_a, norms_a), (params_b, norms_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    assert all(torch.equal(a, b) for a, b in zip(norms_a, norms_b))
    assert not torch.equal(params_a[2], _moe(False)[2].weight)  # the expert weight did train


def test_an_expert_group_without_the_distributed_optimizer_is_refused():
    config = gs.OptimizerConfig(optimizer="sgd", lr=0.1)
    with pytest.raises(ValueError, match="needs use_distributed_optimizer=True"):
        gs.get_optimizer(config, _moe(True), expert_data_parallel_group=object())


def test_an_expert_group_without_torch_distributed_is_refused():
    config = gs.OptimizerConfig(optimizer="sgd", lr=0.1, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        gs.get_optimizer(config, _moe(True), expert_data_parallel_group=object())
