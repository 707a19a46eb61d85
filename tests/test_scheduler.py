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


def lr_at(steps, **kwargs):
    opt = Groups(BASE)
    sched = ParamScheduler(opt, **kwargs)
    sched.step(steps)
    return opt.param_groups[0]["lr"]


def test_warmup_is_linear_from_init_lr():
    assert lr_at(0, lr_warmup_steps=10, lr_decay_steps=100, init_lr=0.0) == 0.0
    assert lr_at(5, lr_warmup_steps=10, lr_decay_steps=100, init_lr=0.0) == pytest.approx(0.5)
    assert lr_at(10, lr_warmup_steps=10, lr_decay_steps=100, init_lr=0.2) == pytest.approx(1.0)


@pytest.mark.parametrize("style, step, expected", [
    ("constant", 50, 1.0),
    ("linear", 55, 0.1 + 0.5 * 0.9),
    ("cosine", 55, 0.1 + 0.5 * 0.9),  # cosine midpoint
    ("cosine", 28, 0.1 + 0.5 * (math.cos(math.pi * 0.2) + 1) * 0.9),
    ("cosine", 100, 0.1),
    ("cosine", 150, 0.1),  # clamped at min_lr after decay
    ("linear", 1000, 0.1),
    ("inverse-square-root", 40, 1.0 * math.sqrt(10) / math.sqrt(40)),
    ("inverse-square-root", 10**6, 0.1),
])
def test_decay_styles(style, step, expected):
    assert lr_at(step, lr_warmup_steps=10, lr_decay_steps=100, lr_decay_style=style) == pytest.approx(expected)


@pytest.mark.parametrize("wsd_style, r_coeff", [
    ("linear", lambda r: 1 - r), ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1)),
    ("exponential", lambda r: 2 * 0.5**r - 1), ("minus_sqrt", lambda r: 1 - math.sqrt(r)),
])
def test_wsd_phases(wsd_style, r_coeff):
    kwargs = dict(lr_warmup_steps=10, lr_decay_steps=100, lr_decay_style="WSD", wsd_decay_steps=20,
                  lr_wsd_decay_style=wsd_style)
    assert lr_at(50, **kwargs) == 1.0  # stable phase
    assert lr_at(80, **kwargs) == 1.0  # anneal starts after step 80
    assert lr_at(90, **kwargs) == pytest.approx(0.1 + r_coeff(0.5) * 0.9)
    assert lr_at(100, **kwargs) == pytest.approx(0.1 + r_coeff(1.0) * 0.9)
    assert lr_at(120, **kwargs) == 0.1


@pytest.mark.parametrize("style, expected", [("linear", 0.05 + 0.25 * 0.1),
                                             ("cosine", 0.05 + 0.5 * (math.cos(math.pi * 0.75) + 1) * 0.1)])
def test_weight_decay_ramp_and_multipliers(style, expected):
    opt = Groups({**BASE, "start_wd": 0.05, "end_wd": 0.15, "lr_mult": 2.0},
                 {**BASE, "start_wd": 0.05, "end_wd": 0.15, "wd_mult": 0.0})
    sched = ParamScheduler(opt, lr_decay_steps=100, lr_decay_style="constant", wd_incr_steps=40, wd_incr_style=style)
    sched.step(10)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(expected)
    assert opt.param_groups[0]["lr"] == 2.0
    assert opt.param_groups[1]["weight_decay"] == 0.0
    sched.step(100)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.15)


def test_state_dict_round_trip():
    a = ParamScheduler(Groups(BASE), lr_warmup_steps=5, lr_decay_steps=50)
    a.step(17)
    opt = Groups(BASE)
    b = ParamScheduler(opt, lr_warmup_steps=1, lr_decay_steps=2, lr_decay_style="linear")
    b.load_state_dict(a.state_dict())
    assert b.num_steps == 17 and opt.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]


def test_drives_the_engine_and_a_plain_torch_optimizer():
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
    plain = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))], **BASE}], lr=1.0)
    ParamScheduler(plain, lr_warmup_steps=2, lr_decay_steps=10).step()
    assert plain.param_groups[0]["lr"] == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr_decay_steps=10, lr_decay_style="step"), "lr_decay_style"),
    (dict(lr_decay_steps=10, wd_incr_style="exp"), "wd_incr_style"),
    (dict(lr_decay_steps=10, lr_warmup_steps=10), "below"),
    (dict(lr_decay_steps=10, lr_decay_style="WSD"), "wsd_decay_steps"),
    (dict(lr_decay_steps=0), "lr_decay_steps"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParamScheduler(Groups(BASE), **kwargs)
