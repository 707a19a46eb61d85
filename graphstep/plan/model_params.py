"""The params the engine takes from a model, and the layout's description of each."""

from __future__ import annotations

import torch

from ..config import OptimizerConfig
from ..config.warn import warn_user
from ..fp8 import is_fp8
from .layout import ParamSpec

_HALF = (torch.float16, torch.bfloat16)


def as_chunks(model_chunks) -> list[torch.nn.Module]:
    """``get_optimizer``'s ``model_chunks`` (an nn.Module or a list of them) as a list of modules."""
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise TypeError("get_optimizer: model_chunks must be an nn.Module or a non-empty list of them")
    return chunks


def named_model_params(model_chunks) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, param)`` of every param of the model, each once (tied params are one); several chunks' names
    are prefixed with the chunk's index."""
    chunks = as_chunks(model_chunks)
    named, seen = [], set()
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name if len(chunks) == 1 else f"{c}.{name}", p))
    return named


def named_trainable_params(model_chunks, dtensors: bool = False) -> list[tuple[str, torch.nn.Parameter]]:
    """``named_model_params``' trainable leaf params. DTensor params are refused unless ``dtensors`` (the
    engine for FSDP2 models, graphstep/fsdp2/, takes them)."""
    named = []
    for name, p in named_model_params(model_chunks):
        if p.requires_grad:
            if is_dtensor(p) and not dtensors:
                raise TypeError(
                    f"param '{name}' is a DTensor (FSDP2's fully_shard, or another torch.distributed.tensor "
                    "parallelism): build the optimizer with gs.get_optimizer, which takes FSDP2 models")
            if not p.is_leaf:
                raise ValueError(f"param '{name}' is not a leaf tensor (it was computed from other tensors): "
                                 "register an nn.Parameter, or freeze it with requires_grad_(False)")
            named.append((name, p))
    if not named:
        raise ValueError("get_optimizer: the model has no trainable parameters")
    return named


def is_dtensor(p: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(p, DTensor)


def _keeps_dtype(p: torch.Tensor) -> bool:
    """Params no config casts: fp8 weights, and an FSDP2 model's local shards (graphstep/fsdp2/shards.py), whose
    compute dtype is FSDP2's ``MixedPrecisionPolicy``'s."""
    return is_fp8(p) or getattr(p, "fsdp2_local_shard", False)


def warn_dtype_conversion(config: OptimizerConfig, named) -> None:
    """Say once, at build, which of the model's params the config casts (``bf16`` / ``fp16`` /
    ``params_dtype``): the model's forward then runs in that dtype, and its inputs must match."""
    target = config.model_dtype
    cast: dict = {}
    for name, p in named:
        if target is not None and p.dtype != target and not _keeps_dtype(p):
            cast.setdefault(p.dtype, []).append(name)
    if not cast:
        return
    source = "params_dtype" if config.params_dtype is not None else ("bf16=True" if config.bf16 else "fp16=True")
    what = "; ".join(f"{len(names)} from {dtype} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                     for dtype, names in cast.items())
    warn_user(f"graphstep: {source} casts the model's params to {target}: {what}. The model now computes in "
              f"{target} (fp32 main params stay inside the optimizer): feed it {target} inputs, or build the model "
              f"in {target} yourself (model.to({target})) to make the choice visible")


def param_spec(config: OptimizerConfig, name: str, p: torch.nn.Parameter, group: int,
               batch_by_shape: bool = False, counted_in_norm: bool = True) -> ParamSpec:
    """The layout's view of one param, refusing dtypes graphstep does not train."""
    if p.is_complex():
        raise ValueError(f"param '{name}' is complex ({p.dtype}): graphstep trains real floating-point params "
                         "only (store a complex weight as torch.view_as_real of a real parameter)")
    dtype = p.dtype if _keeps_dtype(p) else (config.model_dtype or p.dtype)
    if not dtype.is_floating_point:
        raise ValueError(f"param '{name}' has dtype {dtype}: only floating-point params can be trained")
    if dtype == torch.float64:
        source = "params_dtype=torch.float64" if config.model_dtype is not None else f"param '{name}' is float64"
        raise ValueError(f"{source}: graphstep trains float32, bfloat16 and float16 params (its norm and update "
                         "kernels run in fp32 over fp32 main params); cast the model with model.float()")
    grad_dtype = config.main_grads_dtype if dtype in _HALF or is_fp8(p) else dtype
    return ParamSpec(name, tuple(p.shape), dtype, grad_dtype, group, batch_by_shape, counted_in_norm,
                     getattr(p, "fsdp2_padding", 0))
