"""ParamScheduler: Megatron-Core's LR and weight-decay curves at hand-computed points."""

import math
import warnings

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


def test_wsd_without_decay_steps_holds_max_lr_until_lr_decay_steps():
    """Megatron-Core accepts ``wsd_decay_steps=0``: no anneal, max_lr through ``lr_decay_steps``, min_lr after
    (its ``n > lr_decay_steps`` floor comes first, so the anneal's division by 0 is never reached). A WSD
    run's stable phase, kept to branch anneals off later. graphstep refused it."""
    kwargs = dict(lr_decay_style="WSD", wsd_decay_steps=0)
    assert [lr_at(n, **kwargs) for n in (5, 11, 50, 100, 101, 500)] == [0.5, 1.0, 1.0, 1.0, 0.1, 0.1]


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
    """Groups keep ``min_lr=None`` when the config has none (as Megatron-Core's do); every
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
    (dict(lr_decay_style="WSD", wsd_decay_steps=91), "wsd_decay_steps"),  # past the warmup end: README
    (dict(lr_decay_style="WSD", wsd_decay_steps=-1), "wsd_decay_steps"),
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


# ---- against Megatron-Core's own OptimizerParamScheduler (megatron-core 0.16.1; its newest source is the same)

def megatron_scheduler(opt, *, lr_warmup_steps, lr_decay_steps, lr_decay_style="cosine", wd_incr_steps=0,
                       wd_incr_style="constant", init_lr=0.0, wsd_decay_steps=None, lr_wsd_decay_style=None):
    """Megatron-Core's scheduler over ``opt`` with ParamScheduler's keywords (skips without megatron-core).

    Its scheduler-wide ``max_lr`` / ``min_lr`` / ``start_wd`` / ``end_wd`` are fallbacks only: every group here
    carries its own, as graphstep's and Megatron-Core's groups do."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns that Transformer Engine and Apex are missing
        module = pytest.importorskip("megatron.core.optimizer_param_scheduler",
                                     reason="megatron-core is not installed")
    return module.OptimizerParamScheduler(
        opt, init_lr=init_lr, max_lr=1.0, min_lr=0.0, lr_warmup_steps=lr_warmup_steps, lr_decay_steps=lr_decay_steps,
        lr_decay_style=lr_decay_style, start_wd=0.0, end_wd=0.0, wd_incr_steps=wd_incr_steps,
        wd_incr_style=wd_incr_style, wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=lr_wsd_decay_style)


def lr_and_wd(opt):
    return [(group["lr"], group["weight_decay"]) for group in opt.param_groups]


PARITY_GROUPS = (BASE, {**BASE, "max_lr": 3e-4, "min_lr": 3e-5, "start_wd": 0.01, "end_wd": 0.1, "wd_mult": 0.5})
CURVES = ([dict(lr_decay_style=style) for style in ("constant", "linear", "cosine", "inverse-square-root")]
          + [dict(lr_decay_style="WSD", wsd_decay_steps=wsd, lr_wsd_decay_style=wsd_style)
             for wsd in (0, 1, 20, 90) for wsd_style in ("linear", "cosine", "exponential", "minus_sqrt")])


@pytest.mark.parametrize("curve", CURVES, ids=lambda c: "-".join(map(str, c.values())))
def test_every_curve_is_megatron_cores_to_the_last_bit(curve):
    schedule = dict(SCHEDULE, init_lr=1e-5, wd_incr_steps=50, wd_incr_style="cosine", **curve)
    ours, theirs = Groups(*PARITY_GROUPS), Groups(*PARITY_GROUPS)
    sched, reference = ParamScheduler(ours, **schedule), megatron_scheduler(theirs, **schedule)
    for _ in range(130):
        assert lr_and_wd(ours) == lr_and_wd(theirs), sched.num_steps
        sched.step()
        reference.step(1)


@pytest.mark.parametrize("saved_at", [0, 5, 43, 120])
def test_a_normal_resume_is_megatron_cores(saved_at):
    """Resume as a training script does: a fresh scheduler built with the run's settings loads the saved
    state. Megatron-Core adds the saved ``num_steps`` to its 0 and keeps the constructor's ``init_lr`` and
    WSD settings, which are the saved ones here: the same lr and weight decay at every step after."""
    schedule = dict(SCHEDULE, init_lr=1e-5, wd_incr_steps=50, wd_incr_style="linear", lr_decay_style="WSD",
                    wsd_decay_steps=30, lr_wsd_decay_style="cosine")
    their_run = Groups(*PARITY_GROUPS)
    run, reference = ParamScheduler(Groups(*PARITY_GROUPS), **schedule), megatron_scheduler(their_run, **schedule)
    run.step(saved_at)
    reference.step(saved_at)
    ours, theirs = Groups(*PARITY_GROUPS), Groups(*PARITY_GROUPS)
    resumed, their_resumed = ParamScheduler(ours, **schedule), megatron_scheduler(theirs, **schedule)
    resumed.load_state_dict(run.state_dict())
    their_resumed.load_state_dict(reference.state_dict())
    for _ in range(40):  # the lr and weight decay each next optimizer step uses
        assert lr_and_wd(ours) == lr_and_wd(theirs) == lr_and_wd(their_run)
        resumed.step()
        their_resumed.step(1)
        reference.step(1)


def saved_run(steps: int, **schedule) -> dict:
    run = ParamScheduler(Groups(BASE), **{**SCHEDULE, **schedule})
    run.step(steps)
    return run.state_dict()


def megatron_state(steps: int, **schedule) -> dict:
    reference = megatron_scheduler(Groups(BASE), **{**SCHEDULE, **schedule})
    reference.step(steps)
    return reference.state_dict()


def test_load_state_dict_restores_the_saved_position_even_after_steps():
    """README, Differences from Megatron-Core: loading a state saved at step 43 into a scheduler that has
    stepped 5 times puts it at step 43; Megatron-Core's ``load_state_dict`` adds 43 to its 5 (step 48)."""
    opt = Groups(BASE)
    sched = ParamScheduler(opt, **SCHEDULE)
    sched.step(5)
    sched.load_state_dict(saved_run(43))
    assert sched.num_steps == 43 and opt.param_groups[0]["lr"] == lr_at(43)
    theirs = Groups(BASE)
    reference = megatron_scheduler(theirs, **SCHEDULE)
    reference.step(5)
    reference.load_state_dict(megatron_state(43))
    assert reference.num_steps == 48 and theirs.param_groups[0]["lr"] == lr_at(48) != lr_at(43)


def test_load_state_dict_restores_init_lr_and_the_wd_ramp_megatron_core_keeps_from_its_constructor():
    """README, Differences from Megatron-Core: Megatron-Core saves neither ``init_lr`` nor the WSD settings
    (its constructor's stay) and writes the groups at load with the constructor's weight-decay ramp (the
    saved one applies from the next step). graphstep resumes the saved schedule exactly."""
    # Saved at step 4 of a warmup from init_lr=0.5 (lr 0.7); loaded into a scheduler built with init_lr=0.
    opt, theirs = Groups(BASE), Groups(BASE)
    ParamScheduler(opt, **SCHEDULE).load_state_dict(saved_run(4, init_lr=0.5))
    megatron_scheduler(theirs, **SCHEDULE).load_state_dict(megatron_state(4, init_lr=0.5))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.7) and theirs.param_groups[0]["lr"] == pytest.approx(0.4)
    # Saved at step 20 of a linear 0 -> 0.1 ramp over 50 steps (0.04); built with a ramp over 100 steps.
    ramp = {**BASE, "start_wd": 0.0, "end_wd": 0.1}
    opt, theirs = Groups(ramp), Groups(ramp)
    saved = ParamScheduler(Groups(ramp), **SCHEDULE, wd_incr_steps=50, wd_incr_style="linear")
    saved.step(20)
    ParamScheduler(opt, **SCHEDULE, wd_incr_steps=100, wd_incr_style="linear").load_state_dict(saved.state_dict())
    reference = megatron_scheduler(Groups(ramp), **SCHEDULE, wd_incr_steps=50, wd_incr_style="linear")
    reference.step(20)
    megatron_scheduler(theirs, **SCHEDULE, wd_incr_steps=100,
                       wd_incr_style="linear").load_state_dict(reference.state_dict())
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.04)
    assert theirs.param_groups[0]["weight_decay"] == pytest.approx(0.02)


def test_lr_mult_is_applied_where_megatron_core_ignores_it():
    """README, Differences from Megatron-Core: its groups carry ``lr_mult`` (1.0, or an override's value)
    but its scheduler writes ``get_lr(group)`` alone (0.16.1 and the newest source)."""
    group = {**BASE, "max_lr": 1e-3, "min_lr": 0.0, "lr_mult": 0.5}
    ours, theirs = Groups(group), Groups(group)
    ParamScheduler(ours, lr_warmup_steps=0, lr_decay_steps=100, lr_decay_style="constant")
    assert ours.param_groups[0]["lr"] == 5e-4
    megatron_scheduler(theirs, lr_warmup_steps=0, lr_decay_steps=100, lr_decay_style="constant")
    assert theirs.param_groups[0]["lr"] == 1e-3


def test_min_lr_above_max_lr_is_refused_where_megatron_core_climbs_to_it():
    """README, Differences from Megatron-Core: a group with max_lr 1e-5 and min_lr 1e-4 (cosine, no warmup,
    100 steps) runs in Megatron-Core, its lr climbing from 1e-5 to 1e-4: a floor above the peak is a typo."""
    group = {**BASE, "max_lr": 1e-5, "min_lr": 1e-4}
    with pytest.raises(ValueError, match="min_lr=0.0001 exceeds max_lr=1e-05"):
        ParamScheduler(Groups(group), lr_warmup_steps=0, lr_decay_steps=100)
    theirs = Groups(group)
    reference = megatron_scheduler(theirs, lr_warmup_steps=0, lr_decay_steps=100)
    lrs = []
    for _ in range(3):
        lrs.append(theirs.param_groups[0]["lr"])
        reference.step(50)
    assert lrs == pytest.approx([1e-5, 5.5e-5, 1e-4], rel=1e-12)


def test_wsd_decay_steps_past_the_warmup_end_is_refused_where_megatron_core_drops_the_lr_at_once():
    """README, Differences from Megatron-Core: with 10 warmup steps, 100 decay steps and
    ``wsd_decay_steps=180`` the anneal would start at step -80; Megatron-Core skips the part under the warmup,
    and its lr falls from 1.0 at step 10 to 0.468 at step 11 (exponential)."""
    schedule = dict(SCHEDULE, lr_decay_style="WSD", wsd_decay_steps=180, lr_wsd_decay_style="exponential")
    with pytest.raises(ValueError, match="wsd_decay_steps <= lr_decay_steps - lr_warmup_steps \\(90\\)"):
        ParamScheduler(Groups(BASE), **schedule)
    theirs = Groups(BASE)
    reference = megatron_scheduler(theirs, **schedule)
    reference.step(10)
    assert theirs.param_groups[0]["lr"] == 1.0
    reference.step(1)
    assert theirs.param_groups[0]["lr"] == pytest.approx(0.1 + 0.9 * (2 * 0.5 ** (91 / 180) - 1))
    assert theirs.param_groups[0]["lr"] == pytest.approx(0.468, abs=5e-4)
