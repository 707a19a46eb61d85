"""A checkpoint graphstep wrote loads back: an ``exp_avg_sq`` at +inf (a finite grad above ~1.8e19 squared, kept
by torch too, with finite params) is a state, not corruption; NaN, negative second moments and non-finite first
moments or main params are still refused (graphstep/checkpoint/integrity.py ``state_value_problem``)."""

import pytest
import torch

import graphstep as gs
from graphstep.checkpoint.checks import StateDictError

HUGE = 1e30  # its square overflows fp32


def model_and_inputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    g = torch.Generator().manual_seed(3)
    return model, [torch.randn(4, 16, generator=g) for _ in range(3)]


def loss_of(model, inputs, step):
    loss = model(inputs).square().mean()
    return loss * HUGE if step == 0 else loss


def graphstep_optimizer(optimizer="adam"):
    model, inputs = model_and_inputs()
    config = gs.OptimizerConfig(optimizer=optimizer, lr=1e-2, weight_decay=0.1, clip_grad=0.0, capture="eager",
                                kernel="fused")
    opt = gs.get_optimizer(config, model, config_overrides={})
    loss_of(model, inputs[0], 0).backward()
    assert bool(opt.step().update_successful), "a finite grad of 1e30 was skipped"
    opt.zero_grad()
    return model, inputs, opt


def test_torch_keeps_an_inf_second_moment_with_finite_params_and_so_does_graphstep():
    model, inputs, opt = graphstep_optimizer()
    reference, _ = model_and_inputs()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    loss_of(reference, inputs[0], 0).backward()
    torch_opt.step()
    assert any(torch.isinf(s["exp_avg_sq"]).any() for s in torch_opt.state.values())
    assert any(torch.isinf(t).any() for t in opt.buffers.state["exp_avg_sq"])
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.isfinite(a).all() and torch.allclose(a, b, rtol=0, atol=1e-6)


def _snapshot(opt, model):
    return [t.clone() for t in opt.buffers.main_shard] + \
        [t.clone() for ts in opt.buffers.state.values() for t in ts] + [p.detach().clone() for p in model.parameters()]


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("optimizer", ["adam", "ademamix"])
def test_its_state_dict_loads_back_and_the_run_goes_on_as_without_the_round_trip(optimizer):
    model, inputs, opt = graphstep_optimizer(optimizer)
    saved = opt.state_dict()
    before = _snapshot(opt, model)
    opt.load_state_dict(saved)
    assert _equal(_snapshot(opt, model), before)
    twin, _, twin_opt = graphstep_optimizer(optimizer)
    for step in (1, 2):
        for m, o in ((model, opt), (twin, twin_opt)):
            loss_of(m, inputs[step], step).backward()
            o.step()
            o.zero_grad()
    assert _equal(_snapshot(opt, model), _snapshot(twin_opt, twin))


def test_gs_checkpoint_save_then_load_round_trips_an_inf_second_moment(tmp_path):
    model, _, opt = graphstep_optimizer()
    before = _snapshot(opt, model)
    gs.checkpoint.save(opt, tmp_path / "ckpt")
    gs.checkpoint.load(opt, tmp_path / "ckpt")
    assert _equal(_snapshot(opt, model), before)


def _state_dict_with(opt, name, edit):
    saved = opt.state_dict()
    tensors = saved["state"][name] if name != "main_params" else saved["main_params"]
    edit(tensors[0])
    return saved


@pytest.mark.parametrize("name,value,message", [
    ("exp_avg_sq", float("nan"), "NaN"),
    ("exp_avg_sq", -1.0, "negative"),
    ("exp_avg_sq", float("-inf"), "negative"),
    ("exp_avg", float("inf"), "inf"),
    ("exp_avg", float("nan"), "NaN"),
    ("main_params", float("inf"), "inf"),
])
def test_values_torch_cannot_produce_are_still_refused_and_nothing_is_loaded(name, value, message):
    model, _, opt = graphstep_optimizer()
    before = _snapshot(opt, model)
    saved = _state_dict_with(opt, name, lambda t: t.view(-1)[1].fill_(value))
    with pytest.raises(StateDictError, match=message):
        opt.load_state_dict(saved)
    assert _equal(_snapshot(opt, model), before)
