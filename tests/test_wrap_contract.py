"""graphstep.wrap keeps torch.optim's contract: each behaviour against the same torch optimizer unwrapped.

Param sizes are multiples of 16, so torch's fused CPU kernels take no scalar tail and the bitwise claims
hold on every vector width (docs/design.md §8).
"""

import copy
import io

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import graphstep as gs
from graphstep.step.scaler import DynamicLossScaler

FUSED = [
    pytest.param(lambda ps, **kw: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True, **kw), id="sgd"),
    pytest.param(lambda ps, **kw: torch.optim.Adam(ps, lr=0.01, fused=True, **kw), id="adam"),
    pytest.param(lambda ps, **kw: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, fused=True, **kw), id="adamw"),
]


def params(seed: int, shapes=((16, 16), (32,), (16, 4))) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def backward(ps, step: int) -> torch.Tensor:
    """A loss over ``ps`` whose grads differ per param and per step; returns it."""
    loss = sum(((p * (i + 1 + step)).sin() * p).sum() for i, p in enumerate(ps))
    loss.backward()
    return loss


def one_step(ps, opt, step):
    opt.zero_grad()
    backward(ps, step)
    opt.step()


def assert_bitwise(ps, reference):
    for i, (a, b) in enumerate(zip(ps, reference, strict=True)):
        assert torch.equal(a, b), f"param {i}: max |diff| {(a - b).abs().max().item()}"


# ---- add_param_group -------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", FUSED)
@pytest.mark.parametrize("add_at", [0, 3], ids=["before-the-first-step", "after-capture"])
def test_add_param_group_trains_the_new_group_bitwise_as_torch_does(make, add_at):
    plain_ps, wrapped_ps = params(0), params(0)
    plain_new, wrapped_new = params(1, ((16, 16), (16,))), params(1, ((16, 16), (16,)))
    plain, wrapped = make(plain_ps[:2]), gs.wrap(make(wrapped_ps[:2]))
    for step in range(8):
        if step == add_at:  # a float lr, as torch takes it; the second one with the defaults
            for opt, new, old in ((plain, plain_new, plain_ps), (wrapped, wrapped_new, wrapped_ps)):
                opt.add_param_group({"params": [new[0], old[2]], "lr": 0.02})
                opt.add_param_group({"params": [new[1]]})
        for ps, opt in ((plain_ps + plain_new, plain), (wrapped_ps + wrapped_new, wrapped)):
            one_step(ps, opt, step)
    assert wrapped.captured
    assert isinstance(wrapped.param_groups[1]["lr"], torch.Tensor)
    assert_bitwise(wrapped_ps + wrapped_new, plain_ps + plain_new)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(wrapped_new, plain_new))


def test_a_scheduler_drives_the_lr_of_an_added_group():
    plain_ps, wrapped_ps = params(0), params(0)
    plain = torch.optim.SGD(plain_ps[:1], lr=0.05, fused=True)
    wrapped = gs.wrap(torch.optim.SGD(wrapped_ps[:1], lr=0.05, fused=True))
    for opt, ps in ((plain, plain_ps), (wrapped, wrapped_ps)):
        opt.add_param_group({"params": ps[1:], "lr": 0.1})
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0 / (1 + k)) for o in (plain, wrapped)]
    for step in range(6):
        for ps, opt in ((plain_ps, plain), (wrapped_ps, wrapped)):
            one_step(ps, opt, step)
        for s in schedules:
            s.step()
    assert wrapped.captured
    assert float(wrapped.param_groups[1]["lr"]) == plain.param_groups[1]["lr"]
    assert_bitwise(wrapped_ps, plain_ps)


def test_an_added_group_that_would_freeze_is_refused_at_the_call_and_not_added():
    ps = params(0)
    wrapped = gs.wrap(torch.optim.SGD(ps[:1], lr=0.05, fused=True))
    one_step(ps[:1], wrapped, 0)
    with pytest.raises(ValueError, match=r"group 1: SGD without fused=True"):
        wrapped.add_param_group({"params": ps[1:2], "fused": False})
    assert len(wrapped.param_groups) == 1
    wrapped.add_param_group({"params": ps[1:2]})  # the same param, now accepted: nothing was left behind
    assert len(wrapped.param_groups) == 2


def test_an_added_param_needs_its_grad_at_its_first_step_and_is_named():
    ps = params(0)
    wrapped = gs.wrap(torch.optim.SGD(ps[:1], lr=0.05, fused=True))
    one_step(ps[:1], wrapped, 0)
    wrapped.add_param_group({"params": ps[1:2]})
    wrapped.zero_grad()
    backward(ps[:1], 1)
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[0\]"):
        wrapped.step()


# ---- deepcopy and pickle ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make", FUSED)
def test_a_deepcopy_trains_on_as_torchs_deepcopy_does_and_leaves_the_original_alone(make):
    plain_ps, wrapped_ps = params(0), params(0)
    plain, wrapped = make(plain_ps), gs.wrap(make(wrapped_ps), warmup=1)
    for step in range(3):
        for ps, opt in ((plain_ps, plain), (wrapped_ps, wrapped)):
            one_step(ps, opt, step)
    plain_copy, wrapped_copy = copy.deepcopy((plain_ps, plain)), copy.deepcopy((wrapped_ps, wrapped))
    assert isinstance(wrapped_copy[1], gs.CapturedOptimizer)
    before = [p.detach().clone() for p in wrapped_ps]
    for step in range(3, 7):
        for ps, opt in (plain_copy, wrapped_copy):
            one_step(ps, opt, step)
    assert wrapped_copy[1].captured
    assert_bitwise(wrapped_copy[0], plain_copy[0])
    assert_bitwise(wrapped_ps, before)  # the copy owns its params, state and lr tensors
    one_step(wrapped_ps, wrapped, 3)  # and the original still replays over its own
    one_step(plain_ps, plain, 3)
    assert_bitwise(wrapped_ps, plain_ps)


def test_a_deepcopy_keeps_the_loss_scalers_state_in_its_own_tensors():
    ps = params(0)
    scaler = DynamicLossScaler(initial_scale=2.0**10, min_scale=1.0, growth_interval=1, hysteresis=1,
                               device=torch.device("cpu"))
    wrapped = gs.wrap(torch.optim.AdamW(ps, lr=0.01, fused=True), scaler=scaler)
    for step in range(3):
        wrapped.zero_grad()
        wrapped.scale_loss(sum(p.sum() for p in ps) * (step + 1)).backward()
        wrapped.step()
    copied = copy.deepcopy(wrapped)
    assert copied.scaler is not scaler and copied.scaler.scale is not scaler.scale
    assert torch.equal(copied.scaler.scale, scaler.scale)
    assert copied.scale_loss(torch.tensor(1.0)).item() == scaler.scale.item()


def test_a_pickled_wrapped_optimizer_loads_back_and_steps():
    ps = params(0)
    wrapped = gs.wrap(torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True))
    for step in range(2):
        one_step(ps, wrapped, step)
    buffer = io.BytesIO()
    torch.save((ps, wrapped), buffer)
    buffer.seek(0)
    loaded_ps, loaded = torch.load(buffer, weights_only=False)
    reference_ps, reference = copy.deepcopy((ps, wrapped))
    for step in range(2, 5):
        for p, o in ((loaded_ps, loaded), (reference_ps, reference)):
            one_step(p, o, step)
    assert_bitwise(loaded_ps, reference_ps)


# ---- load_state_dict -------------------------------------------------------------------------------------

def _older(state_dict: dict, flags) -> dict:
    """``state_dict`` as an older torch (or a non-fused run) saved it: without ``flags`` in its groups."""
    saved = copy.deepcopy(state_dict)
    for group in saved["param_groups"]:
        for flag in flags:
            group.pop(flag, None)
    return saved


@pytest.mark.parametrize("cls, kwargs", [(torch.optim.Adam, {}), (torch.optim.AdamW, {"weight_decay": 0.1}),
                                         (torch.optim.SGD, {"momentum": 0.9})], ids=["adam", "adamw", "sgd"])
@pytest.mark.parametrize("how", ["non-fused", "older"])
def test_a_state_dict_from_a_non_fused_or_older_run_loads_and_captures(cls, kwargs, how):
    source_ps = params(0)
    source = cls(source_ps, lr=0.01, **kwargs)  # the for-loop kernel: fused is None in its groups
    for step in range(2):
        one_step(source_ps, source, step)
    saved = source.state_dict()
    if how == "older":
        saved = _older(saved, ("foreach", "differentiable", "fused", "maximize", "capturable"))
        for state in saved["state"].values():  # torch before 1.12 saved Adam's step as a number
            if "step" in state:
                state["step"] = state["step"].item()
    plain_ps, wrapped_ps = copy.deepcopy(source_ps), copy.deepcopy(source_ps)
    plain, wrapped = cls(plain_ps, lr=0.01, fused=True, **kwargs), gs.wrap(cls(wrapped_ps, lr=0.01, fused=True,
                                                                               **kwargs))
    plain.load_state_dict(copy.deepcopy(saved))
    for group in plain.param_groups:  # the oracle: torch's fused kernel over the loaded state
        group["fused"], group["foreach"] = True, None
    wrapped.load_state_dict(saved)
    assert all(group["fused"] is True for group in wrapped.param_groups)
    assert cls is torch.optim.SGD or all(group["capturable"] is True for group in wrapped.param_groups)
    for step in range(2, 7):
        for ps, opt in ((plain_ps, plain), (wrapped_ps, wrapped)):
            one_step(ps, opt, step)
    assert wrapped.captured
    assert_bitwise(wrapped_ps, plain_ps)


def test_a_state_dict_saved_by_the_wrapped_optimizer_is_a_snapshot_as_torchs_is():
    ps = params(0)
    wrapped = gs.wrap(torch.optim.SGD(ps, lr=0.05, fused=True))
    one_step(ps, wrapped, 0)
    saved = wrapped.state_dict()
    assert saved["param_groups"][0]["lr"] == 0.05 and not isinstance(saved["param_groups"][0]["lr"], torch.Tensor)
    wrapped.param_groups[0]["lr"].fill_(0.5)  # what a scheduler does between the save and the load
    wrapped.load_state_dict(saved)
    assert float(wrapped.param_groups[0]["lr"]) == 0.05


@pytest.mark.parametrize("make", FUSED)
def test_an_lr_assigned_into_a_group_is_the_lr_of_the_next_step_as_in_torch(make):
    # ``for g in opt.param_groups: g["lr"] = x`` is how many loops set the lr by hand.
    plain_ps, wrapped_ps = params(0), params(0)
    plain, wrapped = make(plain_ps), gs.wrap(make(wrapped_ps))
    held = wrapped.param_groups[0]["lr"]
    for step in range(7):
        if step in (3, 5):
            plain.param_groups[0]["lr"] = 0.5 / step
            wrapped.param_groups[0]["lr"] = 0.5 / step if step == 3 else torch.tensor(0.5 / step, dtype=torch.float64)
        for ps, opt in ((plain_ps, plain), (wrapped_ps, wrapped)):
            one_step(ps, opt, step)
    assert wrapped.captured and wrapped.recaptures == 0
    assert wrapped.param_groups[0]["lr"] is held  # the tensor a scheduler built earlier fills
    assert_bitwise(wrapped_ps, plain_ps)


# ---- step hooks ------------------------------------------------------------------------------------------

def test_every_step_hook_fires_once_per_step_on_warm_up_capture_and_replay_steps():
    ps = params(0)
    raw = torch.optim.AdamW(ps, lr=0.01, fused=True)
    calls = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append("global post")),
        raw.register_step_pre_hook(lambda o, a, k: calls.append("wrapped pre")),
    ]
    wrapped = gs.wrap(raw, warmup=2)
    handles += [wrapped.register_step_pre_hook(lambda o, a, k: calls.append("pre")),
                wrapped.register_step_post_hook(lambda o, a, k: calls.append("post")),
                raw.register_step_post_hook(lambda o, a, k: calls.append("wrapped post"))]
    try:
        per_step = []
        for step in range(5):  # two warm-up steps, the capture, two replays
            calls.clear()
            one_step(ps, wrapped, step)
            per_step.append(sorted(calls))
    finally:
        for handle in handles:
            handle.remove()
    assert wrapped.captured
    expected = sorted(["global pre", "global post", "pre", "post", "wrapped pre", "wrapped post"])
    assert per_step == [expected] * 5


# ---- step(closure) ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", FUSED)
def test_step_returns_the_closures_loss_and_none_without_one_as_torch_does(make):
    plain_ps, wrapped_ps = params(0), params(0)
    plain, wrapped = make(plain_ps), gs.wrap(make(wrapped_ps))
    for step in range(4):
        returned = []
        for ps, opt in ((plain_ps, plain), (wrapped_ps, wrapped)):
            def closure(ps=ps, opt=opt):
                opt.zero_grad()
                return backward(ps, step)
            returned.append(opt.step(closure))
        assert isinstance(returned[1], torch.Tensor) and torch.equal(returned[0], returned[1])
    assert wrapped.captured
    assert_bitwise(wrapped_ps, plain_ps)
    wrapped.zero_grad()
    backward(wrapped_ps, 4)
    assert wrapped.step() is None
    assert wrapped.update_successful.item()  # the step's flag stays readable, without a sync in the step


# ---- params torch's fused CPU kernels get wrong ----------------------------------------------------------

@pytest.mark.parametrize("make", FUSED)
def test_a_param_with_gaps_in_memory_is_refused_at_wrap_under_a_fused_kernel(make):
    strided = torch.zeros(16, 2)[:, 0].requires_grad_()  # a leaf whose elements are 2 apart
    with pytest.raises(ValueError, match=r"group 0: param 1 .* not dense in memory"):
        gs.wrap(make([torch.nn.Parameter(torch.zeros(16)), strided]))


def test_a_param_with_gaps_in_memory_is_refused_by_add_param_group():
    wrapped = gs.wrap(torch.optim.SGD(params(0), lr=0.05, fused=True))
    strided = torch.zeros(16, 2)[:, 0].requires_grad_()
    with pytest.raises(ValueError, match=r"group 1: param 0 .* not dense in memory"):
        wrapped.add_param_group({"params": [strided]})
    assert len(wrapped.param_groups) == 1


@pytest.mark.parametrize("make", FUSED)
def test_a_transposed_param_given_a_grad_of_another_layout_steps_as_a_contiguous_one(make):
    # torch's fused kernels walk param, grad and state in memory order; with a grad laid out apart from the
    # param they pair the wrong elements. wrap keeps its static grad in the param's layout.
    g = torch.Generator().manual_seed(0)
    values = torch.randn(16, 32, generator=g)
    transposed = torch.nn.Parameter(values.t().contiguous().t())  # (16, 32), strides (1, 16)
    contiguous = torch.nn.Parameter(values.clone())
    wrapped, plain = gs.wrap(make([transposed])), make([contiguous])
    for step in range(5):
        grad = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        transposed.grad, contiguous.grad = grad.clone(), grad.clone()  # row-major: not the param's layout
        wrapped.step()
        plain.step()
    assert wrapped.captured
    assert torch.equal(transposed, contiguous)


# ---- param_groups edited behind the optimizer's back -----------------------------------------------------

def test_a_param_put_into_a_group_directly_is_refused_naming_add_param_group():
    ps = params(0)
    wrapped = gs.wrap(torch.optim.SGD(ps[:2], lr=0.05, fused=True))
    one_step(ps[:2], wrapped, 0)
    wrapped.param_groups[0]["params"].append(ps[2])
    wrapped.zero_grad()
    backward(ps, 1)
    with pytest.raises(RuntimeError, match="add_param_group"):
        wrapped.step()
