"""Muon (``OptimizerConfig.optimizer="muon"``): every rule graphstep has about it.

Options: ``MuonOptions`` (``OptimizerConfig.muon``; Megatron-Core's flat ``muon_*`` names): momentum, Nesterov,
Newton–Schulz steps and coefficients, scale mode, matmul precision, QKV splitting, the scalar optimizer, the
tensor-parallel mode. As the config's family it takes 2-D hidden matrices only (``takes``, Megatron-Core's
rule); the other params go to ``MuonOptions.scalar_optimizer``
(graphstep/plan/routing.py). Groups carry ``momentum`` (live, so OneCycleLR may cycle it); the kernel is its
own module, graphstep/kernels/muon.py, over whole-matrix views (graphstep/families/matrix_views.py). State:
``momentum_buffer``. MuP leaves the matrices Muon takes alone; the rest get lr / m. Trains fp32 main
params only, and no fp16 params (Megatron-Core's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import muon as muon_kernels
from ..kernels.newton_schulz import COEFFICIENT_SETS, MATMUL_PRECISIONS, coefficient_schedule
from . import adam, lion, matrix_views
from .base import LR, MOMENTUM, WEIGHT_DECAY, Family, GroupViews, MatrixRules, MupRule, StateSpec, StepScalars

NAME = "muon"
# The families muon_scalar_optimizer may name: elementwise rules Megatron-Core pairs with Muon.
SCALAR_FAMILIES = (adam.NAME, lion.NAME)


def takes(param) -> bool:
    """Whether Muon, as the config's family, updates ``param`` itself unless an override routes it
    elsewhere (Megatron-Core's rule): a 2-D param that is no embedding/output param and is not marked
    ``use_muon=False``."""
    return (param.ndim == 2 and not getattr(param, "is_embedding_or_output_parameter", False)
            and not getattr(param, "shared_embedding", False) and getattr(param, "use_muon", True))


@dataclass(frozen=True)
class MuonOptions:
    """Muon's own options, ``OptimizerConfig(optimizer="muon", muon=MuonOptions(...))`` (Megatron-Core's names,
    less the ``muon_`` prefix, and its defaults)."""

    momentum: float = 0.95
    """EMA momentum μ in [0, 1): ``m = μ·m + (1 − μ)·g``; the initial ``momentum`` of Muon groups (live: a
    schedule may change it every step)."""

    nesterov: bool = False
    """Update with ``(1 − μ)·g + μ·m`` instead of ``m`` (Megatron-Core 0.16.1 spells it ``muon_use_nesterov``)."""

    num_ns_steps: int = 5
    """Newton–Schulz iterations per step (a multiple of 5 for "quintic", at least 8 for "polar_express")."""

    coefficient_type: str = "quintic"
    """Newton–Schulz coefficients: "quintic" (five tuples, cycled), "simple" or "polar_express"."""

    scale_mode: str = "spectral"
    """Update scale of an (r, c) matrix: "spectral" √max(r, c), "shape_scaling" √max(1, r/c) or
    "unit_rms_norm" √(r/c)."""

    extra_scale_factor: float = 1.0
    """Extra factor on the update (0.2 ≈ AdamW's update RMS)."""

    fp32_matmul_prec: str = "medium"
    """Newton–Schulz matmuls: "medium" in bf16 after normalising; "high" / "highest" in fp32."""

    split_qkv: bool = True
    """Orthogonalise fused QKV weights (params with ``qkv_split``) as separate Q, K and V matrices."""

    scalar_optimizer: str = "adam"
    """The family of the params Muon does not take (not 2-D, embedding/output, ``use_muon=False``): "adam" or
    "lion" ("adamw" is read as "adam")."""

    tp_mode: str = "blockwise"
    """Muon on a matrix split over the tensor-parallel group (``tensor_model_parallel``, ``partition_dim``):
    "blockwise" (Megatron-Core's default) orthogonalises each slice alone, "duplicated" all-gathers it and
    orthogonalises the whole matrix on every TP rank, "distributed" runs Newton–Schulz on the slices with
    its Gram matrices all-reduced over the group. The update scale uses the whole matrix's shape in every
    mode."""


def _validate(config, checks) -> None:
    options = config.muon
    checks.number(options, "momentum", low=0.0, low_open=False, high=1.0)
    checks.choice(options, "coefficient_type", tuple(COEFFICIENT_SETS))
    checks.choice(options, "scale_mode", muon_kernels.SCALE_MODES)
    checks.choice(options, "fp32_matmul_prec", MATMUL_PRECISIONS)
    checks.choice(options, "scalar_optimizer", SCALAR_FAMILIES)
    checks.choice(options, "tp_mode", muon_kernels.TP_MODES)
    try:
        coefficient_schedule(options.coefficient_type, options.num_ns_steps)
    except ValueError as exc:
        checks.fail(options, "num_ns_steps", options.num_ns_steps, str(exc))
    checks.number(options, "extra_scale_factor", low=0.0, low_open=True)


def _call(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    options = config.muon
    kernels.muon(views.params, views.grads, views.state["momentum_buffer"], nesterov=options.nesterov,
                 decoupled=config.decoupled_weight_decay, grad_scale=grad_scale, found_inf=scalars.found_inf,
                 ns_steps=options.num_ns_steps, coefficient_type=options.coefficient_type,
                 scale_mode=options.scale_mode, extra_scale_factor=options.extra_scale_factor,
                 fp32_matmul_prec=options.fp32_matmul_prec, qkv_splits=views.qkv_splits,
                 tp_splits=views.tp_splits, tp_mode=options.tp_mode, **hyper)


FAMILY = Family(
    name=NAME,
    title="Muon",
    fields=(LR, WEIGHT_DECAY, MOMENTUM),
    states=tuple(StateSpec(name) for name in muon_kernels.STATE_NAMES),
    validate=_validate,
    group_defaults=lambda config: {"momentum": config.muon.momentum},
    torch_defaults=lambda config: {"momentum": config.muon.momentum},
    mup=MupRule("matrix_like", keeps_lr=takes),
    call=_call,
    kernels=muon_kernels,
    offload=False,
    torch_shaped_groups=False,
    trains_fp16=False,
    main_params_dtypes=(torch.float32,),
    matrices=MatrixRules(
        takes=takes,
        scalar_family=lambda config: config.muon.scalar_optimizer,
        views=matrix_views.matrix_views,
        check=matrix_views.check_whole_matrices,
        splits_fused_qkv=lambda config: config.muon.split_qkv,
        updates_split_matrices_by_slice=lambda config: config.muon.tp_mode == "blockwise",
    ),
)
