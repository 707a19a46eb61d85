"""SGD with momentum (``OptimizerConfig.optimizer="sgd"``): every rule graphstep has about it.

Options: ``SGDOptions`` (``OptimizerConfig.sgd``; flat names ``sgd_momentum``, ``sgd_nesterov``): momentum (0: no
momentum buffer at all) and Nesterov (fixed at build).
Groups carry ``momentum`` (live; 0 between steps runs the fused kernel without buffers, as torch's fused SGD)
and ``nesterov``; the kernel is the configured implementation's ``sgd`` (``ENTRY_POINTS``). State: ``momentum_buffer``
when momentum > 0. MuP: vector-like params get lr x m.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import LR, MOMENTUM, WEIGHT_DECAY, Family, GroupViews, MupRule, StateSpec, StepScalars

NAME = "sgd"


@dataclass(frozen=True)
class SGDOptions:
    """SGD's own options, ``OptimizerConfig(sgd=SGDOptions(...))``."""

    momentum: float = 0.9
    """Momentum in [0, 1); 0 turns the momentum buffer off (no state is allocated)."""

    nesterov: bool = False
    """Use Nesterov momentum (needs ``momentum`` > 0); fixed at build."""


def _validate(config, checks) -> None:
    options = config.sgd
    checks.number(options, "momentum", low=0.0, low_open=False, high=1.0)
    if options.nesterov and options.momentum == 0:
        checks.fail(options, "nesterov", True, "needs momentum > 0")


# The entry point of the configured kernels implementation (graphstep/kernels/) SGD's update calls:
#   sgd(params, grads, momentum_buffers, *, lr, weight_decay, momentum, nesterov, grad_scale, found_inf),
#   ``momentum_buffers`` empty without momentum.
ENTRY_POINTS = ("sgd",)


def _call(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    buffers = views.state.get("momentum_buffer", [])
    if isinstance(hyper["momentum"], float) and hyper["momentum"] == 0.0:
        # A momentum baked as a float (the fused kernel's) that a schedule set to 0: torch's fused SGD then runs
        # without the buffers and leaves them as they are (its kernel refuses buffers with momentum 0), and so
        # does this. A recapture follows any change of a baked value, so the choice is made again at each.
        buffers = []
    kernels.sgd(views.params, views.grads, buffers, nesterov=config.sgd.nesterov, grad_scale=grad_scale,
                found_inf=scalars.found_inf, **hyper)


def _group_problem(group: dict, config) -> Optional[str]:
    if config.sgd.momentum == 0 and group.get("momentum", 0.0) != 0:
        return (f"momentum={group['momentum']!r}, but the optimizer was built with sgd_momentum=0 and keeps no "
                "momentum buffers: build it with sgd_momentum > 0 to schedule momentum (torch's OneCycleLR "
                "cycles it unless cycle_momentum=False)")
    if "nesterov" in group and bool(group["nesterov"]) != config.sgd.nesterov:
        return (f"nesterov={group['nesterov']!r}: fixed at build by OptimizerConfig.sgd_nesterov="
                f"{config.sgd.nesterov}; build a new optimizer to change it")
    return None


def _momentum(config) -> dict:
    return {"momentum": config.sgd.momentum, "nesterov": config.sgd.nesterov}


FAMILY = Family(
    name=NAME,
    title="SGD",
    fields=(LR, WEIGHT_DECAY, MOMENTUM),
    states=(StateSpec("momentum_buffer", needed=lambda config: config.sgd.momentum > 0),),
    validate=_validate,
    group_defaults=_momentum,
    torch_defaults=_momentum,
    mup=MupRule("vector_like"),
    call=_call,
    entry_points=ENTRY_POINTS,
    group_problem=_group_problem,
    offload=True,
    torch_shaped_groups=True,
)
