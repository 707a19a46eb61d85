"""LR and weight-decay schedules with Megatron-Core's semantics (``OptimizerParamScheduler``).

The scheduler writes Python floats into each param group's ``lr`` and ``weight_decay``; the engine copies
them into device tensors before the next step, so a captured step follows the schedule.

Learning rate, per group from its ``max_lr`` / ``min_lr`` and times its ``lr_mult``:
- warmup: linear from ``init_lr`` to ``max_lr`` over ``lr_warmup_steps``;
- then by ``lr_decay_style`` up to ``lr_decay_steps``, and ``min_lr`` after:
  "constant" (max_lr), "linear", "cosine" (half a cosine from max_lr to min_lr),
  "inverse-square-root" (``max_lr · sqrt(warmup) / sqrt(step)``, floored at min_lr, no end),
  "WSD" (warmup-stable-decay: max_lr until the last ``wsd_decay_steps`` of the decay, then annealed
  by ``lr_wsd_decay_style``: "linear", "cosine", "exponential" (``2 · 0.5^r − 1``) or "minus_sqrt"
  (``1 − sqrt(r)``)).
Weight decay, per group from its ``start_wd`` to ``end_wd`` over ``wd_incr_steps`` ("constant",
"linear", "cosine"), times its ``wd_mult``.
The formulas are those of Megatron-Core's ``optimizer_param_scheduler.py`` (NVIDIA/Megatron-LM).
"""

from __future__ import annotations

import math
from typing import Optional

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def _check(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"ParamScheduler: {name}={value!r}: must be one of {', '.join(map(repr, choices))}")


class ParamScheduler:
    def __init__(self, optimizer, *, lr_warmup_steps: int = 0, lr_decay_steps: int, lr_decay_style: str = "cosine",
                 wd_incr_steps: int = 0, wd_incr_style: str = "constant", init_lr: float = 0.0,
                 wsd_decay_steps: Optional[int] = None, lr_wsd_decay_style: str = "exponential"):
        _check("lr_decay_style", lr_decay_style, LR_DECAY_STYLES)
        _check("lr_wsd_decay_style", lr_wsd_decay_style, WSD_DECAY_STYLES)
        _check("wd_incr_style", wd_incr_style, WD_INCR_STYLES)
        if lr_warmup_steps < 0 or lr_decay_steps < 1 or wd_incr_steps < 0 or init_lr < 0:
            raise ValueError(f"ParamScheduler: lr_warmup_steps={lr_warmup_steps}, lr_decay_steps={lr_decay_steps}, "
                             f"wd_incr_steps={wd_incr_steps}, init_lr={init_lr}: steps and init_lr must be "
                             "non-negative, lr_decay_steps at least 1")
        if lr_decay_style != "inverse-square-root" and lr_warmup_steps >= lr_decay_steps:
            raise ValueError(f"ParamScheduler: lr_warmup_steps={lr_warmup_steps} must be below "
                             f"lr_decay_steps={lr_decay_steps}")
        if lr_decay_style == "WSD":
            if wsd_decay_steps is None or not 0 < wsd_decay_steps <= lr_decay_steps - lr_warmup_steps:
                raise ValueError(f"ParamScheduler: WSD needs 0 < wsd_decay_steps <= lr_decay_steps - "
                                 f"lr_warmup_steps, got wsd_decay_steps={wsd_decay_steps}")
        for g, group in enumerate(optimizer.param_groups):
            for key in ("max_lr", "min_lr"):
                if key not in group:
                    raise ValueError(f"ParamScheduler: param group {g} has no {key!r} (graphstep's param groups "
                                     "carry it; for a plain torch optimizer, add it to each group)")
            if wd_incr_style == "constant" and group.get("start_wd", 0.0) != group.get("end_wd", 0.0):
                raise ValueError(f"ParamScheduler: group {g} has start_wd != end_wd with wd_incr_style='constant'")
        self.optimizer = optimizer
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.init_lr = init_lr
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.num_steps = 0
        self._apply()

    def get_lr(self, group: dict) -> float:
        """The learning rate of ``group`` at ``num_steps``, before its ``lr_mult``."""
        max_lr, min_lr, step = group["max_lr"], group["min_lr"], self.num_steps
        warmup = self.lr_warmup_steps
        if warmup > 0 and step <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * step / warmup
        if self.lr_decay_style == "constant":
            return max_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(step, 1)))
        if step > self.lr_decay_steps:
            return min_lr
        ratio = (step - warmup) / (self.lr_decay_steps - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if step <= anneal_start:
                coeff = 1.0
            else:
                r = (step - anneal_start) / self.wsd_decay_steps
                coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": 2.0 * 0.5 ** r - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[self.lr_wsd_decay_style]
        return min_lr + coeff * (max_lr - min_lr)

    def get_wd(self, group: dict) -> float:
        """The weight decay of ``group`` at ``num_steps``, before its ``wd_mult``."""
        start, end = group.get("start_wd", 0.0), group.get("end_wd", 0.0)
        if self.wd_incr_style == "constant" or self.num_steps > self.wd_incr_steps:
            return end
        ratio = self.num_steps / self.wd_incr_steps
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return start + coeff * (end - start)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = float(self.get_lr(group) * group.get("lr_mult", 1.0))
            group["weight_decay"] = float(self.get_wd(group) * group.get("wd_mult", 1.0))

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        self._apply()

    def state_dict(self) -> dict:
        return {key: getattr(self, key) for key in ("num_steps", "lr_warmup_steps", "lr_decay_steps",
                                                    "lr_decay_style", "wd_incr_steps", "wd_incr_style", "init_lr",
                                                    "wsd_decay_steps", "lr_wsd_decay_style")}

    def load_state_dict(self, state_dict: dict) -> None:
        for key, value in state_dict.items():
            if not hasattr(self, key):
                raise ValueError(f"ParamScheduler.load_state_dict: unknown key {key!r}")
            setattr(self, key, value)
        self._apply()
