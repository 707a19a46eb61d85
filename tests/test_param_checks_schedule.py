"""``OptimizerConfig.param_checks``: the checks that read every param run before every step by default, and with
"on_request" before the first step and the step after each ``opt.check_params()``; in between they read no
param, and what they would have caught goes unseen, as the config's docstring says."""

import pytest
import torch

import graphstep as gs
from graphstep.native import param_checks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _optimizer(model, policy: str):
    return gs.get_optimizer(gs.OptimizerConfig(lr=1e-2, capture="eager", param_checks=policy), model)


def _train(model, opt, steps: int = 1) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(2, 16)).sum().backward()
        opt.step()


def _count_param_reads(monkeypatch) -> list:
    """Every call of the per-param reads (graphstep/native/param_checks.py) over a list of any param, appended
    to the list returned (an fp32 model's bf16/fp16 write watch reads an empty one)."""
    calls = []

    def counted(name, read):
        def run(tensors, *args, **kwargs):
            if len(tensors):
                calls.append(name)
            return read(tensors, *args, **kwargs)
        return run

    for name in ("first_unbound", "first_other_version"):
        monkeypatch.setattr(param_checks, name, counted(name, getattr(param_checks, name)))
    return calls


@pytest.mark.parametrize("policy", ["every_step", "on_request"])
def test_the_first_step_reads_every_param(monkeypatch, policy):
    model = _model()
    opt = _optimizer(model, policy)
    calls = _count_param_reads(monkeypatch)
    _train(model, opt)
    assert "first_unbound" in calls


def test_on_request_reads_no_param_after_the_first_step_until_asked(monkeypatch):
    model = _model()
    opt = _optimizer(model, "on_request")
    _train(model, opt)
    calls = _count_param_reads(monkeypatch)
    _train(model, opt, steps=3)
    assert calls == []
    opt.check_params()
    _train(model, opt)
    assert "first_unbound" in calls
    calls.clear()
    _train(model, opt)
    assert calls == []  # one request, one step that reads


def test_every_step_reads_every_param_before_each_step(monkeypatch):
    model = _model()
    opt = _optimizer(model, "every_step")
    _train(model, opt)
    calls = _count_param_reads(monkeypatch)
    _train(model, opt, steps=3)
    assert calls.count("first_unbound") >= 3


@pytest.mark.parametrize("policy", ["every_step", "on_request"])
def test_a_frozen_param_is_refused_at_the_next_step_that_reads_the_params(policy):
    model = _model()
    opt = _optimizer(model, policy)
    _train(model, opt)
    model[0].weight.requires_grad_(False)
    if policy == "on_request":
        _train(model, opt)  # unguarded, as documented: the step goes on
        opt.check_params()
    with pytest.raises(RuntimeError, match="'0.weight' do not require grad"):
        _train(model, opt)


def test_a_replaced_param_is_taken_back_at_the_step_after_a_request():
    model = _model()
    opt = _optimizer(model, "on_request")
    _train(model, opt)
    weight = model[2].weight
    new_values = torch.full_like(weight, 0.5)
    weight.data = new_values.clone()
    _train(model, opt)  # unseen: the step updates the flat buffer, not the new tensor
    assert torch.equal(weight.detach(), new_values)
    opt.check_params()
    _train(model, opt)  # taken back: copied into the flat buffer, a view again, and stepped
    assert weight.data_ptr() == opt.build_record.domain_buffers[0].param_view(2).data_ptr()
    assert not torch.equal(weight.detach(), new_values)


def test_debug_step_reads_every_param_whatever_the_policy():
    model = _model()
    opt = _optimizer(model, "on_request")
    _train(model, opt)
    model[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="'0.weight' do not require grad"):
        opt.debug_step(lambda: model(torch.ones(2, 16)).sum().backward())


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match=r"OptimizerConfig.param_checks='sometimes': must be one of 'every_step', "
                                         r"'on_request'"):
        gs.OptimizerConfig(param_checks="sometimes")


def test_an_iteration_reads_every_param_on_the_schedule_too():
    from _iteration_setup import gpt_with_dropout, loss_fn, micro_batches, optimizer

    from graphstep.iteration import Iteration

    model = gpt_with_dropout()
    iteration = Iteration(model, optimizer(model, param_checks="on_request"), loss_fn, capture="graph", warmup=0)
    iteration(micro_batches(0))
    model.head.weight.requires_grad_(False)
    iteration(micro_batches(1))  # unguarded between requests
    iteration.optimizer.check_params()
    with pytest.raises(RuntimeError, match="'head.weight' do not require grad"):
        iteration(micro_batches(2))
