"""AdEMAMix (``OptimizerConfig.optimizer="ademamix"``): every rule graphstep has about it.

Pagliardini, Ablin, Grangier, "The AdEMAMix Optimizer: Better, Faster, Older" (arXiv:2409.03137): Adam's
bias-corrected fast EMA m1 (β1) and second moment ν (β2), plus a slow EMA m2 (β3, not bias-corrected)
added to m̂1 with weight α; decoupled weight decay. The kernel is its own module,
graphstep/kernels/ademamix.py, whatever ``OptimizerConfig.kernel`` says (there is no fused AdEMAMix).

Options. β1, β2 and ε mean exactly what they mean for Adam (the same EMA with the same bias
correction, the same denominator term), so they are Adam's: ``AdamOptions`` (``OptimizerConfig.adam``,
validated by Adam's rule; every group's ``eps`` already comes from it). AdEMAMix's own: ``AdEMAMixOptions``
(``OptimizerConfig.ademamix``; flat names ``ademamix_beta3``, ``ademamix_alpha``). Weight decay is always
decoupled (the paper's rule): ``decoupled_weight_decay=False`` with ``optimizer="ademamix"`` is refused.

Groups carry ``betas`` = (β1, β2), as Adam's (torch's OneCycleLR cycles ``betas[0]``, the fast EMA's
β1, which the kernel reads live), and ``beta3`` and ``alpha`` as keys of their own: the live table
gives every group every column, so a third ``betas`` entry would be out of range in Adam's and Lion's
groups. Every hyperparameter is live (a device tensor read anew each replay): the paper's warm-up
schedules of α and β3 (``alpha_warmup``, ``beta3_warmup`` below) set ``group["alpha"]`` /
``group["beta3"]`` each step without a recapture.

State: ``exp_avg`` (m1, Adam's first moment, the same name), ``exp_avg_slow`` (m2), ``exp_avg_sq`` (ν,
never negative). MuP: Adam's rule (matrix-like params get lr / m and ε / m): the update is normalised by
√ν̂ as Adam's is. No CPU offload (its host update runs torch's fused CPU kernels; there is none for it).
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
