"""Hyperparameters that pass validation but would break the step, in the config and in ``param_groups`` edited
between steps: each is refused before the step changes anything, or taken as torch takes it."""

import pytest
import torch

import graphstep as gs

MIN_NORMAL_FP32 = 2.0**-126
# The families that divide by √v + ε (Muon's through its scalar params' Adam), as configs.
EPS_FAMILIES = {"adam": dict(optimizer="adam"), "ademamix": dict(optimizer="ademamix"),
                "muon": dict(optimizer="muon", muon_scalar_optimizer="adam")}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))


def _backward(model, step, zero_first_bias=True):
    torch.manual_seed(100 + step)
    model(torch.randn(4, 16)).square().mean().backward()
    if zero_first_bias:  # elements whose grads are exactly 0: Adam's 0 / (√0 + ε) is NaN when ε is 0
        model[0].bias.grad.zero_()


def _optimizer(model, **config):
    return gs.get_optimizer(gs.OptimizerConfig(**{"lr": 1e-2, "clip_grad": 0.0, "capture": "eager", **config}), model)


def _snapshot(opt, model):
    """Everything a step may change: params, every state buffer, the step-wide tensors (the step count)."""
    tensors = [t.detach().clone() for t in opt.tensors.named().values()]
    state = [t.detach().clone() for per_buffer in opt.buffers.state.values() for t in per_buffer if t is not None]
    return [p.detach().clone() for p in model.parameters()] + state + tensors


def _unchanged(before, after):
    return all(torch.equal(a, b) for a, b in zip(before, after))


# ---- eps: validated in float32, the dtype the update adds it in ----------------------------------------------

@pytest.mark.parametrize("eps", [1e-46, 5e-324, 1e-39], ids=["1e-46", "5e-324", "subnormal"])
@pytest.mark.parametrize("family", EPS_FAMILIES)
def test_an_adam_eps_below_the_least_normal_float32_is_refused_by_the_config(family, eps):
    with pytest.raises(ValueError, match=r"OptimizerConfig\.adam_eps=.*float32"):
        gs.OptimizerConfig(adam_eps=eps, **EPS_FAMILIES[family])


@pytest.mark.parametrize("family", EPS_FAMILIES)
def test_the_least_adam_eps_accepted_keeps_zero_grad_elements_finite(family):
    model = _model()
    opt = _optimizer(model, adam_eps=MIN_NORMAL_FP32, kernel="reference", **EPS_FAMILIES[family])
    for step in range(3):
        opt.zero_grad()
        _backward(model, step)
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("eps", [0.0, 1e-46, -1e-8])
@pytest.mark.parametrize("family", EPS_FAMILIES)
def test_a_group_eps_set_at_runtime_is_checked_as_the_configs(family, eps):
    model = _model()
    opt = _optimizer(model, kernel="reference", **EPS_FAMILIES[family])
    opt.zero_grad()
    _backward(model, 0)
    opt.step()
    edited = [group for group in opt.param_groups if "eps" in group and group.get("optimizer", "adam") != "muon"]
    assert edited
    for group in edited:
        group["eps"] = eps
    opt.zero_grad()
    _backward(model, 1)
    before = _snapshot(opt, model)
    with pytest.raises(ValueError, match=r"param group \d+: eps="):
        opt.step()
    assert _unchanged(before, _snapshot(opt, model))
    for group in edited:
        group["eps"] = 1e-8
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---- SGD's momentum scheduled to 0 with momentum buffers ------------------------------------------------------

MOMENTA = [0.9, 0.9, 0.0, 0.0, 0.9, 0.5]


def _step_both_at(*runs, step: int, momentum: float) -> None:
    """One step of each (optimizer, model) run, every group's momentum set to ``momentum`` first."""
    for optimizer, model in runs:
        for group in optimizer.param_groups:
            group["momentum"] = momentum
        optimizer.zero_grad()
        _backward(model, step, zero_first_bias=False)
        optimizer.step()


@pytest.mark.parametrize("capture", ["eager", "graph"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_the_fused_kernel_takes_momentum_0_as_torchs_fused_sgd_bitwise(nesterov, capture):
    """torch's fused SGD runs a group whose momentum is 0 without its buffers (they stay as they are); ours must
    too, where it raised torch's internal ``Expected momentum_buffer_list.empty()`` mid-step."""
    ours, theirs = _model(), _model()
    opt = _optimizer(ours, optimizer="sgd", sgd_momentum=0.9, sgd_nesterov=nesterov, weight_decay=0.0,
                     kernel="fused", capture=capture, capture_warmup_steps=1)
    reference = torch.optim.SGD(theirs.parameters(), lr=1e-2, momentum=0.9, nesterov=nesterov, fused=True)
    for step, momentum in enumerate(MOMENTA):
        _step_both_at((opt, ours), (reference, theirs), step=step, momentum=momentum)
        for a, b in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(a, b), f"step {step} (momentum {momentum})"


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("kernel", ["fused", "reference", "compiled"])
def test_momentum_0_steps_plain_sgd_and_keeps_the_buffers_with_every_kernel(kernel, nesterov):
    # Back at momentum 0.9 the buffers must be the ones before the momentum-0 steps, as torch's (the reference
    # and compiled kernels overwrote them with the grad).
    ours, theirs = _model(), _model()
    opt = _optimizer(ours, optimizer="sgd", sgd_momentum=0.9, sgd_nesterov=nesterov, weight_decay=0.0,
                     kernel=kernel)
    reference = torch.optim.SGD(theirs.parameters(), lr=1e-2, momentum=0.9, nesterov=nesterov)
    for step, momentum in enumerate(MOMENTA):
        _step_both_at((opt, ours), (reference, theirs), step=step, momentum=momentum)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ---- values that break the step, set in param_groups ---------------------------------------------------------

OUT_OF_RANGE = [
    ("adam", dict(optimizer="adam"), "betas", (0.9, 1.0)),  # 1 - β2^t = 0: the bias correction divides by 0
    ("adam", dict(optimizer="adam"), "betas", (1.0, 0.999)),
    ("adam", dict(optimizer="adam"), "betas", (1.5, 2.0)),  # 1 - β2^t < 0: its square root is NaN
    ("adam", dict(optimizer="adam"), "betas", (0.9,)),  # an IndexError from the live table, naming nothing
    ("ademamix", dict(optimizer="ademamix"), "betas", (0.9, 1.0)),
    ("lion", dict(optimizer="lion"), "betas", (0.9, 0.99, 0.999)),  # the third value was ignored without a word
    ("lion", dict(optimizer="lion"), "betas", (0.9,)),
]


@pytest.mark.parametrize("family, config, key, value", OUT_OF_RANGE,
                         ids=[f"{f}-{k}={v}" for f, _, k, v in OUT_OF_RANGE])
@pytest.mark.parametrize("kernel", ["fused", "reference"])
def test_a_group_value_that_breaks_the_step_is_refused_before_the_step_changes_anything(family, config, key, value,
                                                                                         kernel):
    model = _model()
    opt = _optimizer(model, kernel=kernel, **config)
    opt.zero_grad()
    _backward(model, 0)
    opt.step()
    edited = [group for group in opt.param_groups if key in group and group.get("optimizer", family) == family]
    assert edited
    for group in edited:
        group[key] = value
    opt.zero_grad()
    _backward(model, 1)
    before = _snapshot(opt, model)
    with pytest.raises(ValueError, match=rf"param group \d+: {key}="):
        opt.step()
    assert _unchanged(before, _snapshot(opt, model))


def test_an_eps_override_below_the_smallest_normal_float32_is_refused_at_the_build():
    # It passed the override's "> 0" check and was refused only at the first step.
    model = torch.nn.Linear(4, 4)
    overrides = {gs.ParamKey(name="weight"): {"eps": 1e-46}}
    with pytest.raises(ValueError, match="eps=1e-46 must be at least 2\\*\\*-126"):
        gs.get_optimizer(gs.OptimizerConfig(lr=1e-2, capture="eager"), model, config_overrides=overrides)
