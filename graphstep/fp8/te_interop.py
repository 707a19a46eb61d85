"""Transformer Engine interop (the optional extra ``te``): recognise TE's fp8 weights and requantize them
through TE's own cast routine. graphstep never requires TE: nothing here imports it at module load.

A TE fp8 weight (a ``Float8Tensor``) is requantized by TE's ``cast_master_weights_to_fp8``, what Megatron-Core's
distributed optimizer calls (amax, MAX all-reduce, cast, in TE's kernels); a weight made by
``graphstep.fp8.convert`` by graphstep's own cast. TE's routine takes no ``found_inf``: on a skipped step it
recasts unchanged main params with an unchanged scale, which gives the same bytes. ``is_te_fp8`` looks at the
class, never imports TE: a param can only be a TE ``Float8Tensor`` if TE is already imported.
"""

from __future__ import annotations

import importlib
from typing import Callable, Optional, Sequence

import torch

_TE_TENSOR_CLASSES = ("Float8Tensor", "QuantizedTensor")
# TE's quantizer class -> graphstep's recipe name; the others are refused (see te_recipe).
_TE_RECIPES = {"Float8Quantizer": "delayed", "Float8CurrentScalingQuantizer": "tensorwise"}
_TE_CAST = ("transformer_engine.pytorch.tensor.utils", "cast_master_weights_to_fp8")


def te_importable() -> tuple[bool, Optional[str]]:
    """(whether ``transformer_engine.pytorch`` imports here, why not). Imports TE: call it only when TE
    is wanted (tests, diagnostics), never on graphstep's own paths."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as error:  # ImportError, or OSError/RuntimeError when libcuda is missing
        return False, f"{type(error).__name__}: {error}"
    return True, None


def is_te_fp8(param: torch.Tensor) -> bool:
    """Whether ``param`` is a Transformer Engine quantized weight (``Float8Tensor`` and kin), by its class's
    module; never imports TE."""
    return any(cls.__module__.startswith("transformer_engine.") and cls.__name__ in _TE_TENSOR_CLASSES
               for cls in type(param).__mro__)


def te_recipe(quantizer_class_name: str, where: str = "a Transformer Engine fp8 weight") -> str:
    """graphstep's recipe name for TE's quantizer class (``"delayed"`` | ``"tensorwise"``); a clear error for
    the block-scaled recipes, which TE's per-tensor cast routine and graphstep's per-tensor scales do not
    cover."""
    try:
        return _TE_RECIPES[quantizer_class_name]
    except KeyError:
        raise ValueError(f"{where} was made by TE's {quantizer_class_name}: graphstep requantizes per-tensor "
                         "fp8 weights only (TE recipes DelayedScaling -> Float8Quantizer, Float8CurrentScaling "
                         "-> Float8CurrentScalingQuantizer); build the model under te.fp8_model_init with one "
                         "of those recipes, or without fp8_model_init") from None


def recipe_of(param: torch.Tensor, name: str = "param") -> str:
    """The recipe of a TE fp8 weight, from its quantizer."""
    return te_recipe(type(param._get_quantizer()).__name__, f"param '{name}'")


def cast_routine(param: torch.Tensor) -> str:
    """Which cast requantizes ``param``: ``"transformer_engine"`` for TE's fp8 weights, ``"graphstep"`` for
    weights made by ``graphstep.fp8.convert``; ValueError for anything else."""
    from .params import is_fp8

    if is_te_fp8(param):
        return "transformer_engine"
    if is_fp8(param):
        return "graphstep"
    raise ValueError("not an fp8 weight: neither graphstep.fp8.convert nor Transformer Engine's fp8_model_init "
                     "made it")


def te_cast() -> Callable:
    """TE's ``cast_master_weights_to_fp8`` (imports TE; a clear error where it is missing)."""
    module, name = _TE_CAST
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, OSError, RuntimeError) as error:
        raise RuntimeError(f"Transformer Engine's {module}.{name} is not available ({type(error).__name__}: "
                           f"{error}); install the optional extra on a CUDA machine: pip install "
                           "'graphstep[te]'") from None


def requantize_te(weights: Sequence[torch.Tensor], mains: Sequence[Optional[torch.Tensor]],
                  start_offsets: Sequence[Optional[int]], group=None) -> None:
    """Requantize TE fp8 ``weights`` from this rank's fp32 main shards through TE's own routine.

    ``mains[i]`` is this rank's flat slice of weight i's main param (None where the rank owns none of it),
    starting at element ``start_offsets[i]`` of the weight; ``group`` is the data-parallel group the amax is
    MAX-reduced over (None: the default group, or no reduction without torch.distributed). Every recipe is
    checked before TE is called, so an unsupported one is refused with nothing changed.
    """
    if not (len(weights) == len(mains) == len(start_offsets)):
        raise ValueError("requantize_te: weights, mains and start_offsets must have one entry per weight")
    for i, weight in enumerate(weights):
        if not is_te_fp8(weight):
            raise ValueError(f"requantize_te: weight {i} is not a Transformer Engine fp8 weight "
                             f"({type(weight).__name__}); graphstep.fp8 weights go through graphstep's cast")
        recipe_of(weight, f"weight {i}")
    if weights:
        te_cast()(list(weights), list(mains), list(start_offsets), group)
