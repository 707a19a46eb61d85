"""The checks before every step (graphstep/pre_step.py): one declared order, run by ``step()`` as declared,
each reading parts the build record has, and each refusal firing before anything changed."""

import dataclasses
import warnings

import pytest
import torch

import graphstep as gs
from graphstep import assembly, pre_step

DECLARED = ("fsdp2_bindings", "offload_finished", "replaced_params", "requires_grad", "state_kept", "group_edits",
            "torch_grad_scaler", "grads_seen", "fold_notes_writes", "buffers_bound", "param_writes", "fold_stale",
            "family_group_options", "hyperparameters")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _backward(model):
    model(torch.ones(2, 16)).sum().backward()


def test_the_order_is_declared_once():
    assert tuple(check.name for check in pre_step.CHECKS) == DECLARED


def test_each_check_reads_parts_the_build_record_has():
    record = {f.name for f in dataclasses.fields(assembly.Build)} | {"domain_buffers"}
    live = {f"live.{f.name}" for f in dataclasses.fields(pre_step.LiveValues)}
    for check in pre_step.CHECKS:
        assert check.reads and set(check.reads) <= record | live, check.name


def test_step_runs_the_declared_checks_in_their_order(monkeypatch):
    model = _model()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-2), model)
    ran = []

    def recording(check):
        def run(build, live):
            ran.append(check.name)
            check.run(build, live)
        return dataclasses.replace(check, run=run)

    monkeypatch.setattr(pre_step, "CHECKS", tuple(recording(check) for check in pre_step.CHECKS))
    _backward(model)
    opt.step()
    assert tuple(ran) == DECLARED


def _replace_a_param(model, opt):
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())


def _freeze_a_param(model, opt):
    model[0].weight.requires_grad_(False)


def _replace_the_state(model, opt):
    opt.state = {}


def _edit_a_group(model, opt):
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(1)))


def _torch_scaler_over_own_scale(model, opt):
    opt.grad_scale, opt.found_inf = torch.ones(()), torch.zeros(())  # what torch's GradScaler.step sets


def _family_cannot_run_the_group(model, opt):
    opt.param_groups[0]["betas"] = (1.0, 0.999)


REFUSALS = {
    "replaced_params": (_replace_a_param, RuntimeError, "replaced by new Parameter objects"),
    "requires_grad": (_freeze_a_param, RuntimeError, "do not require grad"),
    "state_kept": (_replace_the_state, TypeError, "opt.state was replaced"),
    "group_edits": (_edit_a_group, ValueError, "'params' list was edited"),
    "torch_grad_scaler": (_torch_scaler_over_own_scale, RuntimeError, "scales the loss itself"),
    "family_group_options": (_family_cannot_run_the_group, ValueError, "param group 0: .*beta"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_each_refusal_fires_before_anything_changed(name):
    assert name in DECLARED
    misuse, error, message = REFUSALS[name]
    model = _model()
    scale = 128.0 if name == "torch_grad_scaler" else None  # graphstep's own loss scale
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-2, loss_scale=scale), model)
    _backward(model)
    main = [t.clone() for t in opt.buffers.main_shard]
    misuse(model, opt)
    with pytest.raises(error, match=message):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(main, opt.buffers.main_shard))
    assert int(opt.tensors.step) == 0


def test_the_grads_seen_check_warns_once_without_a_backward():
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-2), _model())
    with pytest.warns(RuntimeWarning, match="step\\(\\) ran before any backward") as caught:
        opt.step()
    assert caught[0].filename == __file__  # pointed at the caller's step(), through the declared checks
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


def _param_reads(monkeypatch) -> list:
    """The lists ``first_unbound`` reads (graphstep/native/param_checks.py), with the expectations it was given."""
    from graphstep.native import param_checks
    read, calls = param_checks.first_unbound, []

    def recorded(tensors, **expected):
        calls.append((tensors, sorted(k for k, v in expected.items() if v is not None)))
        return read(tensors, **expected)

    monkeypatch.setattr(param_checks, "first_unbound", recorded)
    return calls


def test_a_step_visits_each_held_param_once_for_its_data_grad_and_requires_grad(monkeypatch):
    model = _model()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-2), model)
    _backward(model)
    opt.step()
    calls = _param_reads(monkeypatch)
    _backward(model)
    opt.step()
    params = opt.buffers.params
    assert [expected for tensors, expected in calls if tensors is params] == [["data_ptrs", "grads", "requires_grad"]]
    held = {id(p) for p in params}
    assert not any(id(t) in held for tensors, _ in calls if tensors is not params for t in tensors)


def test_an_unbound_grad_is_taken_back_not_refused_as_frozen():
    model = _model()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-2), model)
    _backward(model)
    opt.step()
    model[0].weight.grad = torch.ones_like(model[0].weight)  # ends the pass that reads data, grad and flag
    opt.step()
    assert model[0].weight.grad.data_ptr() == opt.buffers.grad_view(0).data_ptr()


def test_a_frozen_param_after_an_unbound_one_is_still_refused():
    model = _model()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-2), model)
    _backward(model)
    opt.step()
    model[0].weight.grad = torch.zeros_like(model[0].weight)  # unbound first in the layout's order
    model[2].bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match="'2.bias' do not require grad"):
        opt.step()


def test_a_refused_step_leaves_no_verdict_for_a_later_binding_check():
    model = _model()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-2), model)
    _backward(model)
    opt.step()
    _edit_a_group(model, opt)
    with pytest.raises(ValueError, match="'params' list was edited"):  # after the requires_grad watch read all
        opt.step()
    model[0].weight.data = model[0].weight.detach().clone()
    taken_back = pre_step.bind_buffers(opt.build_record)  # what an iteration runs before an evaluation
    assert taken_back == ["param '0.weight'"]
