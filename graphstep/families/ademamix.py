"""AdEMAMix (``OptimizerConfig.optimizer="ademamix"``): every rule graphstep has about it.

Adam's bias-corrected fast EMA and second moment plus a slow EMA (β3, not bias-corrected) added with weight α
(Pagliardini, Ablin, Grangier, arXiv:2409.03137); the kernel is graphstep/kernels/ademamix.py whatever
``OptimizerConfig.kernel`` says. β1, β2 and ε mean what they mean for Adam, so they are Adam's options; its own
are ``AdEMAMixOptions``. Weight decay is always decoupled (the paper's rule). Groups carry ``beta3`` and
``alpha`` as keys of their own (a third ``betas`` entry would be out of range in other families' columns);
every hyperparameter is live, so the warm-up schedules of α and β3 below need no recapture. No CPU offload:
torch has no fused CPU kernel for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kernels import ademamix as ademamix_kernels
from . import adam
from .base import BETA1, BETA2, LR, WEIGHT_DECAY, Family, GroupViews, HyperField, MupRule, StateSpec, StepScalars

NAME = "ademamix"
BETA3 = HyperField("beta3", "beta3")
ALPHA = HyperField("alpha", "alpha")
EPS = HyperField("eps", "eps")  # Adam's column: every group carries eps
_NONNEGATIVE = frozenset({"exp_avg_sq"})


def alpha_warmup(step: int, alpha: float, warmup_steps: int) -> float:
    """The paper's α scheduler: α·t / T_α, rising linearly to ``alpha`` at ``warmup_steps``, then flat."""
    if warmup_steps <= 0:
        return alpha
    return min(step * alpha / warmup_steps, alpha)


def beta3_warmup(step: int, beta3: float, warmup_steps: int, beta_start: float) -> float:
    """The paper's β3 scheduler: from ``beta_start`` (the paper: β1) to ``beta3`` at ``warmup_steps``, with
    the EMA's half-life ln(0.5) / ln(β) growing linearly, then flat."""
    if not 0.0 < beta_start <= beta3 < 1.0:
        raise ValueError(f"beta3_warmup: needs 0 < beta_start <= beta3 < 1, got beta_start={beta_start}, "
                         f"beta3={beta3}")
    if warmup_steps <= 0 or step >= warmup_steps:
        return beta3
    start, end, frac = math.log(beta_start), math.log(beta3), step / warmup_steps
    return min(math.exp(start * end / ((1 - frac) * end + frac * start)), beta3)


@dataclass(frozen=True)
class AdEMAMixOptions:
    """AdEMAMix's own options, ``OptimizerConfig(ademamix=AdEMAMixOptions(...))``; its β1, β2 and ε are
    Adam's (``OptimizerConfig.adam``)."""

    beta3: float = 0.9999
    """Slow-EMA decay β3 in [0, 1); the initial ``beta3`` of AdEMAMix groups (live: the paper's warm-up
    schedules it, ``beta3_warmup``)."""

    alpha: float = 5.0
    """Slow-EMA weight α >= 0 (0: AdamW); the initial ``alpha`` of AdEMAMix groups (live, ``alpha_warmup``)."""


def _validate(config, checks) -> None:
    checks.number(config.ademamix, "beta3", low=0.0, low_open=False, high=1.0)
    checks.number(config.ademamix, "alpha", low=0.0, low_open=False)
    if config.optimizer == NAME and not config.decoupled_weight_decay:
        checks.fail(config, "decoupled_weight_decay", False, "AdEMAMix decays the params directly (decoupled, the "
                    "paper's rule): leave it True with optimizer='ademamix'")


def _group_keys(config) -> dict:
    return {"betas": (config.adam.beta1, config.adam.beta2), "beta3": config.ademamix.beta3,
            "alpha": config.ademamix.alpha}


def _call(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    kernels.ademamix(views.params, views.grads, *(views.state[name] for name in kernels.STATE_NAMES),
                     step=scalars.step, grad_scale=grad_scale, found_inf=scalars.found_inf, **hyper)


FAMILY = Family(
    name=NAME,
    title="AdEMAMix",
    fields=(LR, BETA1, BETA2, BETA3, ALPHA, WEIGHT_DECAY, EPS),
    states=tuple(StateSpec(name, nonnegative=name in _NONNEGATIVE) for name in ademamix_kernels.STATE_NAMES),
    validate=_validate,
    group_defaults=_group_keys,
    torch_defaults=lambda config: {"eps": config.adam.eps, **_group_keys(config)},
    mup=MupRule("matrix_like", eps=lambda config: config.adam.eps),
    call=_call,
    kernels=ademamix_kernels,
    group_problem=adam.group_problem,  # β1, β2 and ε mean what they mean for Adam, and break its update alike
    offload=False,
    torch_shaped_groups=False,
)
