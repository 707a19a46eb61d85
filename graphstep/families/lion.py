"""Lion (``OptimizerConfig.optimizer="lion"``, or Muon's ``MuonOptions.scalar_optimizer="lion"``): every rule
graphstep has about it.

Options: ``LionOptions`` (``OptimizerConfig.lion``; flat names ``lion_beta1``, ``lion_beta2``). Groups carry
``betas`` (live); the kernel is its own module, graphstep/kernels/lion.py, whatever ``OptimizerConfig.kernel``
says. State: ``exp_avg``. MuP: matrix-like params get lr / m. Trains fp32 main params only, and no fp16
params (Megatron-Core's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import lion as lion_kernels
from .base import BETA1, BETA2, LR, WEIGHT_DECAY, Family, GroupViews, MupRule, StateSpec, StepScalars, betas_problem

NAME = "lion"


@dataclass(frozen=True)
class LionOptions:
    """Lion's own options, ``OptimizerConfig(lion=LionOptions(...))`` (Megatron-Core's names and defaults)."""

    beta1: float = 0.95
    """Interpolation β1 in [0, 1): the update is the sign of ``β1·m + (1 − β1)·g``."""

    beta2: float = 0.98
    """Momentum decay β2 in [0, 1)."""


def _validate(config, checks) -> None:
    checks.number(config.lion, "beta1", low=0.0, low_open=False, high=1.0)
    checks.number(config.lion, "beta2", low=0.0, low_open=False, high=1.0)


def _call(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    kernels.lion(views.params, views.grads, views.state["exp_avg"], grad_scale=grad_scale,
                 found_inf=scalars.found_inf, **hyper)


FAMILY = Family(
    name=NAME,
    title="Lion",
    fields=(LR, BETA1, BETA2, WEIGHT_DECAY),
    states=tuple(StateSpec(name) for name in lion_kernels.STATE_NAMES),
    validate=_validate,
    group_defaults=lambda config: {"betas": (config.lion.beta1, config.lion.beta2)},
    torch_defaults=lambda config: {"betas": (config.lion.beta1, config.lion.beta2)},
    mup=MupRule("matrix_like"),
    call=_call,
    kernels=lion_kernels,
    group_problem=lambda group, config: betas_problem(group),  # a pair: sign(·) keeps any values finite
    offload=False,
    torch_shaped_groups=False,
    trains_fp16=False,
    main_params_dtypes=(torch.float32,),
)
