"""Adam / AdamW (``OptimizerConfig.optimizer="adam"``): every rule graphstep has about it.

Config fields: ``adam_beta1``, ``adam_beta2``, ``adam_eps``, ``decoupled_weight_decay`` (AdamW when
True). Groups carry ``betas`` (and ``eps``, which every group has); the kernel is each implementation's
``adam`` / ``adam_groups`` (graphstep/kernels/), all of a step's Adam groups in one call. State:
``exp_avg`` and ``exp_avg_sq`` (never negative). MuP: matrix-like params get lr / m and ε / m.
"""

from __future__ import annotations

from typing import Sequence

from .base import BETA1, BETA2, LR, WEIGHT_DECAY, Family, GroupViews, HyperField, MupRule, StateSpec, StepScalars

NAME = "adam"
EPS = HyperField("eps", "eps")
STATES = (StateSpec("exp_avg"), StateSpec("exp_avg_sq", nonnegative=True))


def _validate(config, checks) -> None:
    checks.number(config, "adam_beta1", low=0.0, low_open=False, high=1.0)
    checks.number(config, "adam_beta2", low=0.0, low_open=False, high=1.0)
    checks.number(config, "adam_eps", low=0.0, low_open=True)


def _call(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    _call_groups(kernels, [(views, hyper)], scalars, config, grad_scale)


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
    group_defaults=lambda config: {"betas": (config.adam_beta1, config.adam_beta2)},
    torch_defaults=lambda config: {"eps": config.adam_eps, "betas": (config.adam_beta1, config.adam_beta2)},
    mup=MupRule("matrix_like", eps=lambda config: config.adam_eps),
    call=_call,
    call_groups=_call_groups,
    offload=True,
    plain_groups=True,
    aliases=("adamw",),
    precision_aware=True,
)
