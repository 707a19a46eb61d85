"""ParamScheduler: Megatron-Core's LR and weight-decay curves at hand-computed points."""

import math

import pytest
import torch

import graphstep as gs
from graphstep.scheduler import ParamScheduler
from toy import loss_fn, tiny_transformer


class Groups:
    """Anything with param_groups in graphstep's format drives the scheduler (duck typing)."""

    def __init__(self, *groups):
        self.param_groups = [dict(g) for g in groups]


BASE = {"max_lr": 1.0, "min_lr": 0.1, "lr_mult": 1.0, "wd_mult": 1.0, "start_wd": 0.0, "end_wd": 0.0}
SCHEDULE = dict(lr_warmup_steps=10, lr_decay_steps=100)


def lr_at(steps, **kwargs):
    opt = Groups(BASE)
    sched = ParamScheduler(opt, **{**SCHEDULE, **kwargs})
    sched.step(steps)
    return opt.param_groups[0]["lr"]


def test_warmup_is_linear_from_init_lr():
    assert lr_at(0) == 0.0
    assert lr_at(5) == pytest.approx(0.5)
    assert lr_at(5, init_lr=0.2) == pytest.approx(0.2 + 0.5 * 0.8)
    assert lr_at(10, init_lr=0.2) == pytest.approx(1.0)  # warmup end: max_lr
    assert lr_at(0, lr_warmup_steps=0) == 1.0  # no warmup: decay starts at max_lr


@pytest.mark.parametrize("style, step, expected", [
    ("constant", 50, 1.0),
    ("constant", 500, 1.0),  # constant is never floored (Megatron-Core)
    ("linear", 11, 1.0 - 0.9 / 90),
    ("linear", 55, 0.1 + 0.5 * 0.9),
    ("linear", 100, 0.1),
    ("linear", 1000, 0.1),
    ("cosine", 55, 0.1 + 0.5 * 0.9),  # cosine midpoint
    ("cosine", 28, 0.1 + 0.5 * (math.cos(math.pi * 0.2) + 1) * 0.9),
    ("cosine", 100, 0.1),
    ("cosine", 150, 0.1),  # clamped at min_lr after decay
    ("inverse-square-root", 10, 1.0),  # warmup end
    ("inverse-square-root", 40, math.sqrt(10) / math.sqrt(40)),  # = 0.5
    ("inverse-square-root", 90, math.sqrt(10) / math.sqrt(90)),
    ("inverse-square-root", 100, math.sqrt(10) / math.sqrt(100)),
    ("inverse-square-root", 101, 0.1),  # floored after lr_decay_steps like every decaying style
])
def test_decay_styles(style, step, expected):
    assert lr_at(step, lr_decay_style=style) == pytest.approx(expected, rel=1e-12)


def test_inverse_square_root_is_floored_at_min_lr_before_the_end():
    group = {**BASE, "min_lr": 0.4}
    opt = Groups(group)
    sched = ParamScheduler(opt, lr_warmup_steps=4, lr_decay_steps=1000, lr_decay_style="inverse-square-root")
    sched.step(16)
    assert opt.param_groups[0]["lr"] == 0.5  # sqrt(4) / sqrt(16)
    sched.step(84)
    assert opt.param_groups[0]["lr"] == 0.4  # 0.2 is below the floor


def test_inverse_square_root_is_megatron_cores_expression_to_the_last_bit():
    # Megatron-Core: max_lr * warmup**0.5 / n**0.5 (Python's pow). math.sqrt rounds otherwise at some steps
    # (58 of 80,000 here: n = 2921 with warmup 1, for one).
    for warmup in (1, 7, 100, 2000):
        opt = Groups({**BASE, "max_lr": 3e-4, "min_lr": 0.0})
        sched = ParamScheduler(opt, lr_warmup_steps=warmup, lr_decay_steps=20_000, lr_decay_style="inverse-square-root")
        sched.step(warmup)
        for n in range(warmup + 1, 20_001):
            sched.step()
            assert opt.param_groups[0]["lr"] == 3e-4 * warmup**0.5 / n**0.5, (warmup, n)


@pytest.mark.parametrize("wsd_style, r_coeff", [
    ("linear", lambda r: 1 - r), ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1)),
    ("exponential", lambda r: 2 * 0.5**r - 1), ("minus_sqrt", lambda r: 1 - math.sqrt(r)),
])
def test_wsd_phases(wsd_style, r_coeff):
    kwargs = dict(lr_decay_style="WSD", wsd_decay_steps=20, lr_wsd_decay_style=wsd_style)
    assert lr_at(5, **kwargs) == pytest.approx(0.5)  # warmup
    assert lr_at(50, **kwargs) == 1.0  # stable phase
    assert lr_at(80, **kwargs) == 1.0  # the last stable step: the anneal starts after step 80
    assert lr_at(85, **kwargs) == pytest.approx(0.1 + r_coeff(0.25) * 0.9)
    assert lr_at(90, **kwargs) == pytest.approx(0.1 + r_coeff(0.5) * 0.9)
    assert lr_at(100, **kwargs) == pytest.approx(0.1 + r_coeff(1.0) * 0.9)
    assert lr_at(120, **kwargs) == 0.1


def test_wsd_ends_at_min_lr_for_every_style():
    for style in ("linear", "cosine", "exponential", "minus_sqrt"):
        assert lr_at(100, lr_decay_style="WSD", wsd_decay_steps=20, lr_wsd_decay_style=style) == \
            pytest.approx(0.1, abs=1e-15)


@pytest.mark.parametrize("style, expected", [("linear", 0.05 + 0.25 * 0.1),
                                             ("cosine", 0.05 + 0.5 * (math.cos(math.pi * 0.75) + 1) * 0.1)])
def test_weight_decay_ramp_and_multipliers(style, expected):
    opt = Groups({**BASE, "start_wd": 0.05, "end_wd": 0.15, "lr_mult": 2.0},
                 {**BASE, "start_wd": 0.05, "end_wd": 0.15, "wd_mult": 0.0},
                 {**BASE, "start_wd": 0.05, "end_wd": 0.15, "wd_mult": 0.5, "max_lr": 0.5, "min_lr": 0.0})
    sched = ParamScheduler(opt, lr_warmup_steps=0, lr_decay_steps=100, lr_decay_style="constant",
                           wd_incr_steps=40, wd_incr_style=style)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.05)  # ramp start
    sched.step(10)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(expected)
    assert opt.param_groups[0]["lr"] == 2.0  # max_lr x lr_mult
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.param_groups[2]["weight_decay"] == pytest.approx(0.5 * expected)
    assert opt.param_groups[2]["lr"] == 0.5
    sched.step(30)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.15)  # ramp end
    sched.step(100)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.15)


def test_lr_mult_scales_every_phase():
    opt = Groups(BASE, {**BASE, "lr_mult": 0.25})
    sched = ParamScheduler(opt, **SCHEDULE, lr_decay_style="linear")
    for steps in (3, 10, 30, 100, 200):
        sched.step(steps - sched.num_steps)
        assert opt.param_groups[1]["lr"] == pytest.approx(0.25 * opt.param_groups[0]["lr"], rel=1e-15)


def test_writes_python_floats():
    opt = Groups({**BASE, "max_lr": 1, "min_lr": 0})  # ints in, floats out
    ParamScheduler(opt, lr_warmup_steps=0, lr_decay_steps=10).step()
    assert type(opt.param_groups[0]["lr"]) is float and type(opt.param_groups[0]["weight_decay"]) is float


def test_state_dict_round_trip():
    a = ParamScheduler(Groups(BASE), lr_warmup_steps=5, lr_decay_steps=50, lr_decay_style="WSD",
                       wsd_decay_steps=10, lr_wsd_decay_style="cosine")
    a.step(43)
    saved = a.state_dict()
    assert saved["num_steps"] == 43 and saved["lr_decay_style"] == "WSD"
    opt = Groups(BASE)
    b = ParamScheduler(opt, lr_warmup_steps=1, lr_decay_steps=2, lr_decay_style="linear")
    b.load_state_dict(saved)
    assert b.state_dict() == saved
    assert opt.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    a.step()
    b.step()
    assert opt.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("change, message", [
    ({"lr_decay_style": "step"}, "lr_decay_style"),
    ({"bogus": 1}, "unknown keys"),
    ({"lr_warmup_steps": 100}, "below"),
    ({"num_steps": -1}, "num_steps"),
])
def test_load_state_dict_validates(change, message):
    sched = ParamScheduler(Groups(BASE), **SCHEDULE)
    saved = {**sched.state_dict(), **change}
    with pytest.raises(ValueError, match=message):
        sched.load_state_dict(saved)
    assert sched.num_steps == 0 and sched.lr_warmup_steps == 10  # nothing half-loaded


def test_drives_a_plain_torch_sgd():
    param = torch.nn.Parameter(torch.ones(2))
    plain = torch.optim.SGD([{"params": [param], "max_lr": 1.0, "min_lr": 0.0}], lr=1.0, weight_decay=0.01)
    sched = ParamScheduler(plain, lr_warmup_steps=2, lr_decay_steps=10)
    assert plain.param_groups[0]["lr"] == 0.0
    sched.step()
    assert plain.param_groups[0]["lr"] == pytest.approx(0.5)
    assert plain.param_groups[0]["weight_decay"] == 0.01  # kept: start_wd = end_wd = its weight_decay
    param.grad = torch.ones(2)
    plain.step()
    assert param.detach().tolist() == pytest.approx([1 - 0.5 * 1.01] * 2)


def test_drives_the_captured_engine():
    model = tiny_transformer()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, min_lr=1e-4, capture="graph", capture_warmup_steps=1), model)
    sched = ParamScheduler(opt, lr_warmup_steps=2, lr_decay_steps=10)
    seen = []
    for step in range(6):
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.step()
        seen.append(opt.hyper.tensor("lr", 0).item())  # the lr the (captured) step used
        sched.step()
    assert seen == pytest.approx([0.0, 5e-4, 1e-3, 1e-4 + 0.5 * (math.cos(math.pi / 8) + 1) * 9e-4,
                                  1e-4 + 0.5 * (math.cos(math.pi / 4) + 1) * 9e-4,
                                  1e-4 + 0.5 * (math.cos(3 * math.pi / 8) + 1) * 9e-4])
    assert opt.param_groups[1]["weight_decay"] == 0.0  # the no-decay group keeps wd_mult 0


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "WSD", "constant"])
def test_min_lr_none_is_read_as_zero(style):
    """Issue 11.10: groups keep ``min_lr=None`` when the config has none (as Megatron-Core's do); every
    curve must then equal the one floored at 0."""
    extra = dict(wsd_decay_steps=30) if style == "WSD" else {}
    none, zero = Groups({**BASE, "min_lr": None}), Groups({**BASE, "min_lr": 0.0})
    scheds = [ParamScheduler(opt, **SCHEDULE, lr_decay_style=style, **extra) for opt in (none, zero)]
    for _ in range(120):
        assert none.param_groups[0]["lr"] == zero.param_groups[0]["lr"]
        for sched in scheds:
            sched.step()
    assert none.param_groups[0]["min_lr"] is None  # read as 0, never rewritten
    if style != "constant":
        assert none.param_groups[0]["lr"] == 0.0


def test_drives_the_engine_built_without_min_lr():
    model = tiny_transformer()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, capture="eager"), model)
    assert all(group["min_lr"] is None for group in opt.param_groups)
    sched = ParamScheduler(opt, lr_warmup_steps=2, lr_decay_steps=4, lr_decay_style="linear")
    lrs = []
    for step in range(6):
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.step()
        lrs.append(opt.hyper.tensor("lr", 0).item())
        sched.step()
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 5e-4, 0.0, 0.0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr_decay_style="step"), "lr_decay_style"),
    (dict(lr_wsd_decay_style="square"), "lr_wsd_decay_style"),
    (dict(wd_incr_style="exp"), "wd_incr_style"),
    (dict(lr_warmup_steps=100), "below"),
    (dict(lr_warmup_steps=-1), "lr_warmup_steps"),
    (dict(lr_warmup_steps=1.5), "lr_warmup_steps"),
    (dict(lr_decay_style="WSD"), "wsd_decay_steps"),
    (dict(lr_decay_style="WSD", wsd_decay_steps=91), "wsd_decay_steps"),
    (dict(lr_warmup_steps=0, lr_decay_steps=0), "lr_decay_steps"),
    (dict(wd_incr_style="linear"), "wd_incr_steps"),  # a ramp over 0 steps
    (dict(init_lr=-1.0), "init_lr"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParamScheduler(Groups(BASE), **{**SCHEDULE, **kwargs})


@pytest.mark.parametrize("group, message", [
    ({"max_lr": 1.0}, "no 'min_lr'"),
    ({**BASE, "min_lr": 2.0}, "exceeds max_lr"),
    ({**BASE, "start_wd": 0.0, "end_wd": 0.1}, "start_wd=0.0 != end_wd=0.1"),
])
def test_bad_groups_are_named(group, message):
    with pytest.raises(ValueError, match=message):
        ParamScheduler(Groups(group), **SCHEDULE)
