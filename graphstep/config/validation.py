"""Validation of ``OptimizerConfig``: every field's type, range and consistency with the others, in one
place; ``validate`` raises ValueError naming the first field that is wrong and what it must be. A family's
options (``OptimizerConfig.muon``, a ``MuonOptions``) are checked by the family's own rule (``Family.validate``,
graphstep/families/), given the checks every other field gets; a message names an option as Megatron-Core
spells it and as its class does: ``OptimizerConfig.muon_momentum=1.5 (MuonOptions.momentum): ...``."""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import typing
from typing import TYPE_CHECKING

import torch

from capture.devices import MODES as CAPTURE_MODES

from ..families import FAMILIES, get_family

KERNELS = ("auto", "fused", "compiled", "reference")
INVALIDATION_POLICIES = ("recapture", "raise")
PARAM_CHECKS = ("every_step", "on_request")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Storage dtypes of Adam's moments: torch.uint8 is Megatron-Core's spelling of fp8 (its --exp-avg-dtype fp8).
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn)
MAX_LOSS_SCALE = 2.0**127
"""The largest power of two a float32 holds: the dynamic scale never grows past it (and so stays finite)."""
MIN_LOSS_SCALE = 2.0**-126
"""The smallest normal float32: below it ``inv_scale = 1 / scale`` would overflow to inf."""

if TYPE_CHECKING:
    from . import OptimizerConfig


def fail(field: str, value, allowed: str, where: str = "") -> None:
    """Raise ValueError naming ``OptimizerConfig.<field>``, its value, and (``where``) the option it is."""
    raise ValueError(f"OptimizerConfig.{field}={value!r}{where}: {allowed}")


def _refer(config: OptimizerConfig, owner, field: str) -> tuple[str, str]:
    """How a message names ``owner.field`` (``owner`` the config, or one of its family options): its flat name
    (``muon_momentum``, Megatron-Core's) and, for an option, ``" (MuonOptions.momentum)"``."""
    if owner is config:
        return field, ""
    holder = next(f.name for f in dataclasses.fields(config) if getattr(config, f.name) is owner)
    return f"{holder}_{field}", f" ({type(owner).__name__}.{field})"


def _check_choice(config: OptimizerConfig, field: str, choices: tuple, owner=None) -> None:
    owner = config if owner is None else owner
    value = getattr(owner, field)
    if value not in choices:
        name, where = _refer(config, owner, field)
        fail(name, value, "must be one of " + ", ".join(repr(c) for c in choices), where)


def _check_number(config: OptimizerConfig, field: str, *, low: float, low_open: bool, high: float = math.inf,
                  high_open: bool = True, optional: bool = False, owner=None) -> None:
    owner = config if owner is None else owner
    value = getattr(owner, field)
    if value is None and optional:
        return
    name, where = _refer(config, owner, field)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        fail(name, value, "must be a number", where)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        fail(name, value, f"must lie in {left}{low}, {high}{right}", where)


class _FamilyChecks:
    """What a family's own rule (``Family.validate(config, checks)``) checks its options and the config's fields
    with: the checks every field gets, each given the object holding the field (the config or an options)."""

    def __init__(self, config: OptimizerConfig) -> None:
        self._config = config

    def number(self, owner, field: str, **bounds) -> None:
        _check_number(self._config, field, owner=owner, **bounds)

    def choice(self, owner, field: str, choices: tuple) -> None:
        _check_choice(self._config, field, choices, owner=owner)

    def fail(self, owner, field: str, value, allowed: str) -> None:
        name, where = _refer(self._config, owner, field)
        fail(name, value, allowed, where)

# What a value of each annotated type must be. bool is a subclass of int, so it is refused explicitly where
# a number is meant: OptimizerConfig(bucket_size=True) is a mistake, not a bucket of one element.
_TYPE_RULES = {
    bool: (lambda v: isinstance(v, bool), "a bool (True or False)"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number (int or float)"),
    str: (lambda v: isinstance(v, str), "a str"),
    torch.dtype: (lambda v: isinstance(v, torch.dtype), "a torch.dtype"),
    collections.abc.Callable: (callable, "callable"),
}


def check_type(field: str, value, hint, where: str = "") -> None:
    """Refuse (naming ``OptimizerConfig.<field>``) a ``value`` that is not of type ``hint`` (Optional[X]: None or
    X; a dataclass: an instance of it)."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) is typing.Union and type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else hint
    base = typing.get_origin(base) or base  # Callable[...] -> collections.abc.Callable
    if value is None and optional:
        return
    if dataclasses.is_dataclass(base):
        accepts, what = (lambda v: isinstance(v, base)), f"a {base.__name__}"
    else:
        accepts, what = _TYPE_RULES[base]
    if not accepts(value):
        fail(field, value, f"must be {what}{' or None' if optional else ''}, got {type(value).__name__}", where)


def _check_types(config: OptimizerConfig) -> None:
    """Every field against its annotation, and every family option against its own, before any range check.

    Without this, truthiness decides: ``fp16="False"`` is a non-empty string and would turn fp16 on.
    """
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        check_type(field.name, value, hints[field.name])
        if dataclasses.is_dataclass(value):
            option_hints = typing.get_type_hints(type(value))
            for option in dataclasses.fields(value):
                name, where = _refer(config, value, option.name)
                check_type(name, getattr(value, option.name), option_hints[option.name], where)


def validate(config: OptimizerConfig) -> None:
    """Raise ValueError naming the first field of the wrong type, out of range or inconsistent with another."""
    _check_types(config)
    _check_choice(config, "optimizer", tuple(FAMILIES))
    _check_choice(config, "capture", CAPTURE_MODES)
    _check_choice(config, "kernel", KERNELS)
    _check_choice(config, "capture_invalidation", INVALIDATION_POLICIES)
    _check_choice(config, "param_checks", PARAM_CHECKS)

    _check_number(config, "lr", low=0.0, low_open=False)
    for field in ("min_lr", "decoupled_lr", "decoupled_min_lr"):
        _check_number(config, field, low=0.0, low_open=False, optional=True)
    if config.min_lr is not None and config.min_lr > config.lr:
        fail("min_lr", config.min_lr, f"must not exceed lr={config.lr}")
    _check_number(config, "weight_decay", low=0.0, low_open=False)
    checks = _FamilyChecks(config)
    for family in FAMILIES.values():  # every family's options, whichever family the config names
        family.validate(config, checks)

    if config.fp16 and config.bf16:
        fail("bf16", True, "fp16 and bf16 are exclusive; set one")
    for field in ("params_dtype", "main_params_dtype", "main_grads_dtype"):
        value = getattr(config, field)
        if value is None and field == "params_dtype":
            continue
        if value not in _FLOAT_DTYPES:
            fail(field, value, "must be a torch floating dtype (float32, bfloat16, float16, float64)")
    half = (torch.float16, torch.bfloat16)
    if config.fp16 and config.params_dtype not in (None, torch.float32, torch.float16):
        fail("params_dtype", config.params_dtype, "must be torch.float16, torch.float32 or None with fp16=True")
    if config.bf16 and config.params_dtype not in (None, torch.float32, torch.bfloat16):
        fail("params_dtype", config.params_dtype, "must be torch.bfloat16, torch.float32 or None with bf16=True")
    if config.params_dtype in half and not (config.fp16 or config.bf16):
        fail("params_dtype", config.params_dtype, "half params need fp16=True or bf16=True")

    # Scales live in fp32 tensors: scale and 1 / scale must both be finite there (graphstep.step.scaler).
    for field in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
        value = getattr(config, field)
        if value is not None and not MIN_LOSS_SCALE <= value <= MAX_LOSS_SCALE:  # NaN fails this too
            fail(field, value, "must lie in [2**-126, 2**127] (the scale and 1 / scale are fp32 tensors)")
    if config.min_loss_scale > config.initial_loss_scale:
        fail("min_loss_scale", config.min_loss_scale,
             f"must not exceed initial_loss_scale={config.initial_loss_scale}")
    for field in ("loss_scale_window", "hysteresis", "capture_warmup_steps"):
        value = getattr(config, field)
        minimum = 0 if field == "capture_warmup_steps" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            fail(field, value, f"must be an integer >= {minimum}")

    if config.kernel == "compiled" and config.capture == "graph" and config.capture_warmup_steps < 1:
        fail("capture_warmup_steps", config.capture_warmup_steps,
             "kernel='compiled' compiles on its first step, which must run before a CUDA graph is captured: "
             "use capture_warmup_steps >= 1")

    _check_number(config, "clip_grad", low=0.0, low_open=False)
    _check_number(config, "grad_norm_skip_threshold", low=0.0, low_open=True, high=math.inf, high_open=False)
    if config.bucket_size is not None and config.bucket_size < 1:
        fail("bucket_size", config.bucket_size, "must be a positive integer number of elements, or None")
    if (config.overlap_grad_reduce or config.overlap_param_gather) and not config.use_distributed_optimizer:
        field = "overlap_grad_reduce" if config.overlap_grad_reduce else "overlap_param_gather"
        fail(field, True, "needs use_distributed_optimizer=True")
    _check_number(config, "distributed_timeout_s", low=0.0, low_open=True)
    _validate_qk_clip(config)
    _validate_precision_aware(config)
    _validate_megatron_only(config)
    _validate_for_family(config)
    _validate_fp8(config)
    _validate_offload(config)


def _validate_precision_aware(config: OptimizerConfig) -> None:
    """Megatron-Core's rules: state and main params below fp32 only with ``use_precision_aware_optimizer``,
    which only Adam has."""
    for field in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        value = getattr(config, field)
        if value not in STATE_DTYPES:
            fail(field, value, "must be torch.float32, torch.bfloat16, torch.float16 or fp8 (torch.uint8 or "
                 "torch.float8_e4m3fn)")
        if value != torch.float32 and not config.use_precision_aware_optimizer:
            fail(field, value, "below fp32 needs use_precision_aware_optimizer=True")
    allowed = (torch.float32, torch.float64, torch.float16)
    if config.main_params_dtype not in allowed:
        fail("main_params_dtype", config.main_params_dtype, "must be torch.float32, torch.float64 or torch.float16")
    if config.main_params_dtype == torch.float16:
        if not config.use_precision_aware_optimizer:
            fail("main_params_dtype", config.main_params_dtype,
                 "torch.float16 needs use_precision_aware_optimizer=True")
        if not (config.bf16 or config.fp16):
            fail("main_params_dtype", config.main_params_dtype, "torch.float16 stores the main params of half params: "
                 "set bf16=True or fp16=True (fp32 params are their own main params)")
    stored_main = config.use_precision_aware_optimizer and (
        config.main_params_dtype == torch.float16 or (config.store_param_remainders and config.bf16))
    if stored_main:
        field = "main_params_dtype" if config.main_params_dtype == torch.float16 else "store_param_remainders"
        for other, why in (("fp8_recipe", "fp8 weights requantize from fp32 main params"),
                           ("qk_clip", "QK-clip rescales fp32 main params"),
                           ("optimizer_cpu_offload", "the host update runs on fp32 main params")):
            if getattr(config, other):
                fail(field, getattr(config, field), f"keeps the main params below fp32, and {why}: set {other} off "
                     f"(or store_param_remainders=False / main_params_dtype=torch.float32)")
    if config.use_precision_aware_optimizer and not get_family(config.optimizer).precision_aware:
        aware = [family.name for family in FAMILIES.values() if family.precision_aware]
        fail("use_precision_aware_optimizer", True, f"stores the state of optimizer={' or '.join(map(repr, aware))} "
             f"below fp32 (as Megatron-Core's), not of optimizer={config.optimizer!r}")
    low = [f for f in ("exp_avg_dtype", "exp_avg_sq_dtype") if getattr(config, f) != torch.float32]
    if low and config.optimizer_cpu_offload:
        fail(low[0], getattr(config, low[0]), "state below fp32 stays on the device: not with optimizer_cpu_offload")


def _validate_megatron_only(config: OptimizerConfig) -> None:
    """Megatron-Core's switches for graphstep settings, against the settings (its fields for features graphstep
    does not offer are refused by the adapter, config/megatron.py)."""
    if config.use_layer_wise_distributed_optimizer and not get_family(config.optimizer).batch_by_shape:
        whole = [family.name for family in FAMILIES.values() if family.batch_by_shape]
        fail("use_layer_wise_distributed_optimizer", True, f"shards whole matrices (optimizer="
             f"{' or '.join(map(repr, whole))}); optimizer={config.optimizer!r} shards with "
             "use_distributed_optimizer=True")
    if config.optimizer_cuda_graph and config.capture == "eager":
        fail("optimizer_cuda_graph", True, "asks for a captured step, capture='eager' for none: set one")


def _validate_qk_clip(config: OptimizerConfig) -> None:
    _check_number(config, "qk_clip_threshold", low=0.0, low_open=True)
    _check_number(config, "qk_clip_alpha", low=0.0, low_open=True, high=1.0)


def _validate_for_family(config: OptimizerConfig) -> None:
    """What the config's family refuses of the rest of the config (Lion and Muon: fp16 params, fp64 main
    params, as Megatron-Core does)."""
    family = get_family(config.optimizer)
    if config.fp16 and not family.trains_fp16:
        fail("fp16", True, f"optimizer={config.optimizer!r} does not train fp16 params (Megatron-Core rejects "
             "it too): use bf16=True")
    if config.main_params_dtype not in family.main_params_dtypes + ((torch.float16,) if family.precision_aware else ()):
        fail("main_params_dtype", config.main_params_dtype,
             f"optimizer={config.optimizer!r} runs on fp32 main params: use torch.float32")


def _validate_fp8(config: OptimizerConfig) -> None:
    if config.fp8_recipe is not None:
        _check_choice(config, "fp8_recipe", ("tensorwise", "delayed"))
    _check_choice(config, "fp8_amax_compute_algo", ("max", "most_recent"))
    for field, minimum in (("fp8_margin", 0), ("fp8_amax_history_len", 1)):
        value = getattr(config, field)
        if value < minimum:
            fail(field, value, f"must be an integer >= {minimum}")
    if config.fp8_recipe == "tensorwise" and config.fp8_amax_history_len != 1:
        fail("fp8_amax_history_len", config.fp8_amax_history_len,
             "applies to fp8_recipe='delayed' only; leave it 1 with 'tensorwise'")
    if config.fp8_recipe is not None and config.main_params_dtype != torch.float32:
        fail("main_params_dtype", config.main_params_dtype, "must be torch.float32 with fp8 weights")


def _validate_offload(config: OptimizerConfig) -> None:
    """The hybrid CPU offload fields and what offload does not combine with."""
    _check_number(config, "optimizer_offload_fraction", low=0.0, low_open=False, high=1.0, high_open=False)
    if not config.optimizer_cpu_offload:
        if config.optimizer_offload_fraction > 0:
            fail("optimizer_offload_fraction", config.optimizer_offload_fraction,
                 "needs optimizer_cpu_offload=True (or leave the fraction 0)")
        if config.overlap_cpu_optimizer_d2h_h2d:
            fail("overlap_cpu_optimizer_d2h_h2d", True, "needs optimizer_cpu_offload=True")
        return
    if not get_family(config.optimizer).offload:
        hosted = [family for family in FAMILIES.values() if family.offload]
        fail("optimizer_cpu_offload", True, f"runs {' and '.join(f.title for f in hosted)} updates on the host, "
             f"not optimizer={config.optimizer!r}: use optimizer={' or '.join(repr(f.name) for f in hosted)}")
    if not config.pin_cpu_grads and config.capture != "eager":
        # The grads' device-to-host copy is part of the device step: into pageable memory it blocks the host,
        # which a CUDA capture refuses (and a CPU-only replay could not notice: there both sides are host).
        fail("pin_cpu_grads", False, f"puts a blocking copy into pageable host memory inside the captured step "
             f"(capture={config.capture!r}); keep pin_cpu_grads=True, or use capture='eager'")
    if config.fp8_recipe is not None:
        fail("optimizer_cpu_offload", True, "does not requantize fp8 weights on the host: leave fp8_recipe None")
    if config.qk_clip:
        fail("optimizer_cpu_offload", True, "QK-clip rescales main params on the device: turn qk_clip off")
    if config.main_params_dtype != torch.float32:
        fail("main_params_dtype", config.main_params_dtype, "must be torch.float32 with optimizer_cpu_offload "
             "(the host update runs torch's fused CPU kernels on fp32 main params)")
