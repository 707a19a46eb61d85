"""The params the engine takes from a model, and the layout's description of each (moved out of engine.py)."""

from __future__ import annotations

import torch

from .config import OptimizerConfig
from .fp8 import is_fp8
from .layout import ParamSpec

_HALF = (torch.float16, torch.bfloat16)


def named_trainable_params(model_chunks) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, param)`` of every trainable leaf param, each once (tied params are one); several chunks'
    names are prefixed with the chunk's index."""
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise TypeError("get_optimizer: model_chunks must be an nn.Module or a non-empty list of them")
    named, seen = [], set()
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = name if len(chunks) == 1 else f"{c}.{name}"
            if not p.is_leaf:
                raise ValueError(f"param '{name}' is not a leaf tensor (it was computed from other tensors): "
                                 "register an nn.Parameter, or freeze it with requires_grad_(False)")
            named.append((name, p))
    if not named:
        raise ValueError("get_optimizer: the model has no trainable parameters")
    return named


def param_spec(config: OptimizerConfig, name: str, p: torch.nn.Parameter, group: int,
                batch_by_shape: bool = False) -> ParamSpec:
    """The layout's view of one param, refusing dtypes graphstep does not train."""
    if p.is_complex():
        raise ValueError(f"param '{name}' is complex ({p.dtype}): graphstep trains real floating-point params "
                         "only (store a complex weight as torch.view_as_real of a real parameter)")
    dtype = p.dtype if is_fp8(p) else (config.model_dtype or p.dtype)  # fp8 weights stay fp8
    if not dtype.is_floating_point:
        raise ValueError(f"param '{name}' has dtype {dtype}: only floating-point params can be trained")
    if dtype == torch.float64:
        source = "params_dtype=torch.float64" if config.model_dtype is not None else f"param '{name}' is float64"
        raise ValueError(f"{source}: graphstep trains float32, bfloat16 and float16 params (its norm and update "
                         "kernels run in fp32 over fp32 main params); cast the model with model.float()")
    grad_dtype = config.main_grads_dtype if dtype in _HALF or is_fp8(p) else dtype
    return ParamSpec(name, tuple(p.shape), dtype, grad_dtype, group, batch_by_shape)
