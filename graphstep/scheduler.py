"""LR and weight-decay schedules with Megatron-Core's semantics (``OptimizerParamScheduler``).

Megatron users expect its curves (warmup, then constant / linear / cosine / inverse-square-root / WSD, floored at
a per-group ``min_lr``) and its per-group ``max_lr`` / ``min_lr`` / ``lr_mult`` / ``wd_mult`` / ``start_wd`` /
``end_wd``, which ``graphstep.plan.overrides.build_param_groups`` puts into every group. The scheduler only
writes Python floats into each group's ``lr`` and ``weight_decay``; the engine copies them to device tensors
before the next step (docs/design.md law 3), so a captured step follows the schedule.

The formulas and the order of their checks are Megatron-Core's ``get_lr`` / ``get_wd``
(megatron/core/optimizer_param_scheduler.py), equal to the last bit (tests/test_scheduler.py runs both) except
where docs/megatron-differences.md says otherwise: ``lr_mult`` applied, inconsistent settings refused, and
``load_state_dict`` restoring the saved schedule exactly.
"""

from __future__ import annotations

import math
from typing import Optional

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")

# What state_dict saves besides num_steps: the settings that shape the curves.
SETTINGS = ("lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "wd_incr_steps", "wd_incr_style", "init_lr",
            "wsd_decay_steps", "lr_wsd_decay_style")


def _fail(message: str) -> None:
    raise ValueError(f"ParamScheduler: {message}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        _fail(f"{name}={value!r}: must be one of {', '.join(map(repr, choices))}")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(f"{name}={value!r}: must be an integer >= {minimum}")


def _floor(group: dict) -> float:
    """The group's ``min_lr``, None read as 0."""
    return 0.0 if group["min_lr"] is None else group["min_lr"]


def validate_settings(settings: dict) -> None:
    """Raise ValueError naming the first setting that is out of range or inconsistent with another.

    Shared by the constructor and ``load_state_dict``, so a checkpoint cannot bring in a schedule the
    constructor would have refused (e.g. a division by zero at the first ``step``).
    """
    _check_choice("lr_decay_style", settings["lr_decay_style"], LR_DECAY_STYLES)
    _check_choice("lr_wsd_decay_style", settings["lr_wsd_decay_style"], WSD_DECAY_STYLES)
    _check_choice("wd_incr_style", settings["wd_incr_style"], WD_INCR_STYLES)
    _check_int("lr_warmup_steps", settings["lr_warmup_steps"], 0)
    _check_int("lr_decay_steps", settings["lr_decay_steps"], 1)
    if settings["lr_warmup_steps"] >= settings["lr_decay_steps"]:
        _fail(f"lr_warmup_steps={settings['lr_warmup_steps']} must be below "
              f"lr_decay_steps={settings['lr_decay_steps']}")
    # A ramp needs at least one step to ramp over (r = n / wd_incr_steps).
    _check_int("wd_incr_steps", settings["wd_incr_steps"], 0 if settings["wd_incr_style"] == "constant" else 1)
    init_lr = settings["init_lr"]
    if isinstance(init_lr, bool) or not isinstance(init_lr, (int, float)) or not 0 <= init_lr < math.inf:
        _fail(f"init_lr={init_lr!r}: must be a finite number >= 0")
    if settings["lr_decay_style"] == "WSD":
        # An anneal longer than the steps after warmup would start inside the warmup, which Megatron-Core
        # then skips: the lr falls at once after warmup. 0 is no anneal at all (the stable phase alone).
        wsd = settings["wsd_decay_steps"]
        room = settings["lr_decay_steps"] - settings["lr_warmup_steps"]
        if isinstance(wsd, bool) or not isinstance(wsd, int) or not 0 <= wsd <= room:
            _fail(f"lr_decay_style='WSD' needs an integer 0 <= wsd_decay_steps <= lr_decay_steps - lr_warmup_steps "
                  f"({room}), got wsd_decay_steps={wsd!r}")


class ParamScheduler:
    """Megatron-Core's warmup/decay LR and weight-decay ramps over an optimizer's ``param_groups``.

    ``optimizer`` is anything with ``param_groups`` (graphstep's engine, or a plain torch optimizer whose
    groups carry ``max_lr`` and ``min_lr``; ``min_lr`` None means 0). A group without ``start_wd`` /
    ``end_wd`` keeps its current ``weight_decay`` as both (written into the group, so a state-dict round
    trip sees it); ``lr_mult`` and ``wd_mult`` default to 1. The constructor applies step 0 at once, like
    Megatron-Core's ``step(0)``. A group whose ``min_lr`` exceeds its ``max_lr`` is refused (Megatron-Core
    would raise its lr towards the floor).
    """

    def __init__(self, optimizer, *, lr_warmup_steps: int, lr_decay_steps: int, lr_decay_style: str = "cosine",
                 wd_incr_steps: int = 0, wd_incr_style: str = "constant", init_lr: float = 0.0,
                 wsd_decay_steps: Optional[int] = None, lr_wsd_decay_style: str = "exponential"):
        settings = dict(lr_warmup_steps=lr_warmup_steps, lr_decay_steps=lr_decay_steps,
                        lr_decay_style=lr_decay_style, wd_incr_steps=wd_incr_steps, wd_incr_style=wd_incr_style,
                        init_lr=init_lr, wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=lr_wsd_decay_style)
        validate_settings(settings)
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, (list, tuple)):
            raise TypeError(f"ParamScheduler: {type(optimizer).__name__} has no param_groups list")
        for g, group in enumerate(groups):
            for key in ("max_lr", "min_lr"):
                if key not in group:
                    _fail(f"param group {g} has no {key!r} (graphstep's param groups carry it; for a plain "
                          "torch optimizer, add max_lr and min_lr to each group)")
            if _floor(group) > group["max_lr"]:
                _fail(f"param group {g}: min_lr={group['min_lr']} exceeds max_lr={group['max_lr']}")
            group.setdefault("start_wd", group.get("weight_decay", 0.0))
            group.setdefault("end_wd", group.get("weight_decay", 0.0))
            if wd_incr_style == "constant" and group["start_wd"] != group["end_wd"]:
                _fail(f"param group {g} has start_wd={group['start_wd']} != end_wd={group['end_wd']}; "
                      "give a wd_incr_style ('linear' or 'cosine') to ramp between them")
        self.optimizer = optimizer
        for key, value in settings.items():
            setattr(self, key, value)
        self.num_steps = 0
        self._apply()

    def get_lr(self, group: dict) -> float:
        """The learning rate of ``group`` at ``num_steps``, before its ``lr_mult``."""
        max_lr, min_lr, n = group["max_lr"], _floor(group), self.num_steps
        warmup, decay = self.lr_warmup_steps, self.lr_decay_steps
        if warmup > 0 and n <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * n / warmup
        if self.lr_decay_style == "constant":
            return max_lr
        if n > decay:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            # Megatron-Core's expression, pow and all: math.sqrt rounds otherwise at a few steps.
            return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / max(n, 1) ** 0.5)
        if self.lr_decay_style == "WSD":
            coeff = self._wsd_coeff(n)
        else:
            ratio = (n - warmup) / (decay - warmup)
            coeff = 1.0 - ratio if self.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, n: int) -> float:
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if n <= anneal_start:  # n <= lr_decay_steps here, so wsd_decay_steps 0 never reaches the division
            return 1.0  # the stable phase
        r = (n - anneal_start) / self.wsd_decay_steps
        style = self.lr_wsd_decay_style
        if style == "linear":
            return 1.0 - r
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * r) + 1.0)
        if style == "exponential":
            return 2.0 * 0.5**r - 1.0
        return 1.0 - math.sqrt(r)  # minus_sqrt

    def get_wd(self, group: dict) -> float:
        """The weight decay of ``group`` at ``num_steps``, before its ``wd_mult``."""
        start, end = group["start_wd"], group["end_wd"]
        if self.wd_incr_style == "constant" or self.num_steps > self.wd_incr_steps:
            return end
        ratio = self.num_steps / self.wd_incr_steps
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return start + coeff * (end - start)

    def _apply(self) -> None:
        # lr_mult applies: an override that sets it means it (Megatron-Core's scheduler ignores the field).
        for group in self.optimizer.param_groups:
            group["lr"] = float(self.get_lr(group) * group.get("lr_mult", 1.0))
            group["weight_decay"] = float(self.get_wd(group) * group.get("wd_mult", 1.0))

    def step(self, increment: int = 1) -> None:
        """Advance by ``increment`` steps and write every group's ``lr`` and ``weight_decay``."""
        _check_int("step(increment)", increment, 0)
        self.num_steps += increment
        self._apply()

    def state_dict(self) -> dict:
        """``num_steps`` and the settings (plain Python values: the per-group bounds live in the groups)."""
        return {"num_steps": self.num_steps, **{key: getattr(self, key) for key in SETTINGS}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take over a saved schedule (settings and position) and write the groups at once.

        The saved settings win over the constructor's, as with Megatron-Core's default
        ``use_checkpoint_opt_param_scheduler=True``; they are validated like the constructor's. Unlike
        Megatron-Core, which adds the saved ``num_steps`` to its own, keeps its constructor's ``init_lr`` and
        WSD settings (it saves none of them) and writes the groups with its constructor's weight-decay ramp,
        the schedule resumes exactly as saved whatever the scheduler did before; on the usual resume (a fresh
        scheduler with the run's settings) both give the same lr and weight decay.
        """
        unknown = set(state_dict) - set(SETTINGS) - {"num_steps"}
        if unknown:
            _fail(f"load_state_dict: unknown keys {sorted(unknown)}")
        settings = {key: state_dict.get(key, getattr(self, key)) for key in SETTINGS}
        validate_settings(settings)
        num_steps = state_dict.get("num_steps", self.num_steps)
        _check_int("load_state_dict: num_steps", num_steps, 0)
        for key, value in settings.items():
            setattr(self, key, value)
        self.num_steps = num_steps
        self._apply()
