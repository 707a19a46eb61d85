"""SGD with momentum (``OptimizerConfig.optimizer="sgd"``): every rule graphstep has about it.

Config fields: ``sgd_momentum`` (0: no momentum buffer at all) and ``sgd_nesterov`` (fixed at build).
Groups carry ``momentum`` (live; 0 between steps runs the fused kernel without buffers, as torch's fused SGD)
and ``nesterov``; the kernel is each implementation's ``sgd`` (graphstep/kernels/). State: ``momentum_buffer``
when momentum > 0. MuP: vector-like params get lr x m.
"""

from __future__ import annotations

from typing import Optional

from .base import LR, MOMENTUM, WEIGHT_DECAY, Family, GroupViews, MupRule, StateSpec, StepScalars

NAME = "sgd"


def _validate(config, checks) -> None:
    checks.number(config, "sgd_momentum", low=0.0, low_open=False, high=1.0)
    if config.sgd_nesterov and config.sgd_momentum == 0:
        checks.fail("sgd_nesterov", True, "needs sgd_momentum > 0")


def _call(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    buffers = views.state.get("momentum_buffer", [])
    if isinstance(hyper["momentum"], float) and hyper["momentum"] == 0.0:
        # A momentum baked as a float (the fused kernel's) that a schedule set to 0: torch's fused SGD then runs
        # without the buffers and leaves them as they are (its kernel refuses buffers with momentum 0), and so
        # does this. A recapture follows any change of a baked value, so the choice is made again at each.
        buffers = []
    kernels.sgd(views.params, views.grads, buffers, nesterov=config.sgd_nesterov, grad_scale=grad_scale,
                found_inf=scalars.found_inf, **hyper)


def _group_problem(group: dict, config) -> Optional[str]:
    if config.sgd_momentum == 0 and group.get("momentum", 0.0) != 0:
        return (f"momentum={group['momentum']!r}, but the optimizer was built with sgd_momentum=0 and keeps no "
                "momentum buffers: build it with sgd_momentum > 0 to schedule momentum (torch's OneCycleLR "
                "cycles it unless cycle_momentum=False)")
    if "nesterov" in group and bool(group["nesterov"]) != config.sgd_nesterov:
        return (f"nesterov={group['nesterov']!r}: fixed at build by OptimizerConfig.sgd_nesterov="
                f"{config.sgd_nesterov}; build a new optimizer to change it")
    return None


def _momentum(config) -> dict:
    return {"momentum": config.sgd_momentum, "nesterov": config.sgd_nesterov}


FAMILY = Family(
    name=NAME,
    title="SGD",
    fields=(LR, WEIGHT_DECAY, MOMENTUM),
    states=(StateSpec("momentum_buffer", needed=lambda config: config.sgd_momentum > 0),),
    validate=_validate,
    group_defaults=_momentum,
    torch_defaults=_momentum,
    mup=MupRule("vector_like"),
    call=_call,
    group_problem=_group_problem,
    offload=True,
    torch_shaped_groups=True,
)
