"""Adam / AdamW (``OptimizerConfig.optimizer="adam"``): every rule graphstep has about it.

Options: ``AdamOptions`` (``OptimizerConfig.adam``; Megatron-Core's ``adam_beta1``, ``adam_beta2``, ``adam_eps``),
and the config's ``decoupled_weight_decay`` (AdamW when True). Groups carry ``betas`` (and ``eps``, which every
group has), checked before each step (``group_problem``); the kernel is the configured implementation's
``adam_groups`` (``ENTRY_POINTS``), all of a step's Adam groups in one call. State:
``exp_avg`` and ``exp_avg_sq`` (never negative). MuP: matrix-like params get lr / m and ε / m.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .base import (BETA1, BETA2, LR, MIN_EPS, WEIGHT_DECAY, Family, GroupViews, HyperField, MupRule, StateSpec,
                   StepScalars, betas_problem, eps_problem, first_problem)

NAME = "adam"
EPS = HyperField("eps", "eps")
STATES = (StateSpec("exp_avg"), StateSpec("exp_avg_sq", nonnegative=True))


@dataclass(frozen=True)
class AdamOptions:
    """Adam's own options, ``OptimizerConfig(adam=AdamOptions(...))``; AdEMAMix reads them too (its β1, β2
    and ε mean what they mean for Adam)."""

    beta1: float = 0.9
    """First-moment decay, in [0, 1); the initial ``betas[0]`` of Adam groups."""

    beta2: float = 0.999
    """Second-moment decay, in [0, 1); the initial ``betas[1]`` of Adam groups."""

    eps: float = 1e-8
    """Denominator term, at least 2**-126 (the smallest normal float32: the update adds it in float32); the
    ``eps`` of every param group, whatever its family."""


def _validate(config, checks) -> None:
    options = config.adam
    checks.number(options, "beta1", low=0.0, low_open=False, high=1.0)
    checks.number(options, "beta2", low=0.0, low_open=False, high=1.0)
    checks.number(options, "eps", low=0.0, low_open=True)
    if options.eps < MIN_EPS:
        checks.fail(options, "eps", options.eps, f"must be at least 2**-126 ({MIN_EPS:.4g}), the smallest normal "
                    "float32: the update adds it to √v in float32, where a smaller eps is 0 (or a subnormal that "
                    "flush-to-zero arithmetic reads as 0) and an element whose grads were all 0 gets 0 / 0 = NaN")


def group_problem(group: dict, config) -> Optional[str]:
    """What in ``group`` (edited between steps) would make Adam's step NaN, or None; AdEMAMix's rule too. A beta
    of 1 makes the bias correction 1 - beta**step 0, one above 1 negative (β2: the square root of a negative
    number), a negative β2 can make the second moment negative; an eps below ``MIN_EPS`` gives 0 / 0."""
    return first_problem(betas_problem(group, unit_interval_why="the config's range, outside which the bias "
                                       "correction or the second moment can turn the update NaN"), eps_problem(group))


def _call(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    _call_groups(kernels, [(views, hyper)], scalars, config, grad_scale)


# The entry point of the configured kernels implementation (graphstep/kernels/) Adam's update calls:
#   adam_groups(groups, *, step, decoupled, grad_scale, found_inf), each group (params, grads, exp_avgs,
#   exp_avg_sqs, {lr, beta1, beta2, weight_decay, eps}): all of a step's Adam groups in one call.
ENTRY_POINTS = ("adam_groups",)


def _call_groups(kernels, groups: Sequence, scalars: StepScalars, config, grad_scale) -> None:
    kernels.adam_groups([(views.params, views.grads, views.state["exp_avg"], views.state["exp_avg_sq"], hyper)
                         for views, hyper in groups], step=scalars.step, decoupled=config.decoupled_weight_decay,
                        grad_scale=grad_scale, found_inf=scalars.found_inf)


FAMILY = Family(
    name=NAME,
    title="Adam",
    fields=(LR, BETA1, BETA2, WEIGHT_DECAY, EPS),
    states=STATES,
    validate=_validate,
    group_defaults=lambda config: {"betas": (config.adam.beta1, config.adam.beta2)},
    torch_defaults=lambda config: {"eps": config.adam.eps, "betas": (config.adam.beta1, config.adam.beta2)},
    mup=MupRule("matrix_like", eps=lambda config: config.adam.eps),
    call=_call,
    call_groups=_call_groups,
    entry_points=ENTRY_POINTS,
    group_problem=group_problem,
    offload=True,
    torch_shaped_groups=True,
    aliases=("adamw",),
    precision_aware=True,
)
