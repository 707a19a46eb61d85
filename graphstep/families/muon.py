"""Muon (``OptimizerConfig.optimizer="muon"``): every rule graphstep has about it.

Config fields: the ``muon_*`` fields (momentum, Nesterov, Newton–Schulz steps and coefficients, scale
mode, matmul precision, QKV splitting, the scalar optimizer). As the config's family it takes 2-D hidden
matrices only (``takes``, Megatron-Core's rule); the other params go to ``muon_scalar_optimizer``
(graphstep/plan/routing.py). Groups carry ``momentum`` (live, so OneCycleLR may cycle it); the kernel is its
own module, graphstep/kernels/muon.py, over whole-matrix views (graphstep/families/matrix_views.py). State:
``momentum_buffer``. MuP leaves the matrices Muon takes alone; the rest get lr / m. Trains fp32 main
params only, and no fp16 params (Megatron-Core's rule).
"""

from __future__ import annotations

import torch

from ..kernels import muon as muon_kernels
from ..kernels.newton_schulz import COEFFICIENT_SETS, MATMUL_PRECISIONS, coefficient_schedule
from . import adam, lion, matrix_views
from .base import LR, MOMENTUM, WEIGHT_DECAY, Family, GroupViews, MupRule, StateSpec, StepScalars

NAME = "muon"
# The families muon_scalar_optimizer may name: elementwise rules Megatron-Core pairs with Muon.
SCALAR_FAMILIES = (adam.NAME, lion.NAME)


def takes(param) -> bool:
    """Whether Muon, as the config's family, updates ``param`` itself unless an override routes it
    elsewhere (Megatron-Core's rule): a 2-D param that is no embedding/output param and is not marked
    ``use_muon=False``."""
    return (param.ndim == 2 and not getattr(param, "is_embedding_or_output_parameter", False)
            and not getattr(param, "shared_embedding", False) and getattr(param, "use_muon", True))


def _validate(config, checks) -> None:
    checks.number(config, "muon_momentum", low=0.0, low_open=False, high=1.0)
    checks.choice(config, "muon_coefficient_type", tuple(COEFFICIENT_SETS))
    checks.choice(config, "muon_scale_mode", muon_kernels.SCALE_MODES)
    checks.choice(config, "muon_fp32_matmul_prec", MATMUL_PRECISIONS)
    checks.choice(config, "muon_scalar_optimizer", SCALAR_FAMILIES)
    checks.choice(config, "muon_tp_mode", muon_kernels.TP_MODES)
    steps = config.muon_num_ns_steps
    if isinstance(steps, bool) or not isinstance(steps, int):
        checks.fail("muon_num_ns_steps", steps, "must be an int")
    try:
        coefficient_schedule(config.muon_coefficient_type, steps)
    except ValueError as exc:
        checks.fail("muon_num_ns_steps", steps, str(exc))
    checks.number(config, "muon_extra_scale_factor", low=0.0, low_open=True)


def _call(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    kernels.muon(views.params, views.grads, views.state["momentum_buffer"], nesterov=config.muon_nesterov,
                 decoupled=config.decoupled_weight_decay, grad_scale=grad_scale, found_inf=scalars.found_inf,
                 ns_steps=config.muon_num_ns_steps, coefficient_type=config.muon_coefficient_type,
                 scale_mode=config.muon_scale_mode, extra_scale_factor=config.muon_extra_scale_factor,
                 fp32_matmul_prec=config.muon_fp32_matmul_prec, qkv_splits=views.qkv_splits,
                 tp_splits=views.tp_splits, tp_mode=config.muon_tp_mode, **hyper)


FAMILY = Family(
    name=NAME,
    title="Muon",
    fields=(LR, WEIGHT_DECAY, MOMENTUM),
    states=tuple(StateSpec(name) for name in muon_kernels.STATE_NAMES),
    validate=_validate,
    group_defaults=lambda config: {"momentum": config.muon_momentum},
    torch_defaults=lambda config: {"momentum": config.muon_momentum},
    mup=MupRule("matrix_like", keeps_lr=takes),
    call=_call,
    kernels=muon_kernels,
    views=matrix_views.matrix_views,
    check=matrix_views.check_whole_matrices,
    offload=False,
    torch_shaped_groups=False,
    trains_fp16=False,
    main_params_dtypes=(torch.float32,),
    takes=takes,
    scalar_family=lambda config: config.muon_scalar_optimizer,
    splits_fused_qkv=lambda config: config.muon_split_qkv,
    updates_split_matrices_by_slice=lambda config: config.muon_tp_mode == "blockwise",
)
