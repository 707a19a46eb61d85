"""fp8 weights a model can train with, without Transformer Engine: ``convert`` and ``Fp8Linear``.

A converted weight is an ``nn.Parameter`` whose storage *is* the fp8 bytes, with an :class:`Fp8Meta` of fp32
scale tensors. autograd casts a grad to its input's dtype, so its high-precision grad goes into
``weight.main_grad`` (Megatron-Core's "gradient accumulation fusion" route) and ``.grad`` stays None. Not a
tensor subclass reporting a high-precision dtype (TE's Float8Tensor): graphstep checks bindings by data pointer
and every capture backend would have to see through a wrapper; plain tensors are ordinary static tensors.
Forward dequantizes, then multiplies. Convert on the device and dtype the model trains in: ``Module.to`` does not
move a param's attributes. Code that reads a Linear's weight instead of calling it sees fp8 bytes (e.g. the
fast path of ``nn.TransformerEncoderLayer``: ``torch.backends.mha.set_fastpath_enabled(False)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .scaling import AMAX_COMPUTE_ALGOS, RECIPES, amax, dequantize, fp8_max, quantize, scale_from_amax


@dataclass(frozen=True)
class Fp8Meta:
    """The scaling state of one fp8 weight: static tensors, updated in place by the optimizer step."""

    recipe: str  # "tensorwise" | "delayed"
    dtype: torch.dtype
    scale: torch.Tensor  # 0-d fp32: the scale the next cast uses (delayed) / the last cast used (tensorwise)
    scale_inv: torch.Tensor  # 0-d fp32: 1 / the scale the current data was cast with
    amax_history: torch.Tensor  # 1-d fp32, newest first (length 1 for tensorwise)
    margin: int = 0
    amax_compute_algo: str = "most_recent"


def is_fp8(param: torch.Tensor) -> bool:
    """Whether ``param`` is a weight converted by :func:`convert`."""
    return getattr(param, "fp8_meta", None) is not None


def dequantized(param: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The high-precision values an fp8 weight stands for (a new tensor)."""
    return dequantize(param.detach(), param.fp8_meta.scale_inv, dtype)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        w = dequantized(weight, x.dtype)
        ctx.save_for_backward(x, w)
        ctx.weight = weight
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        grad_x = grad_out @ w
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        # The weight grad goes to main_grad (bf16/fp32); the fp8 leaf itself gets none (see module doc).
        ctx.weight.main_grad.add_(flat_grad.t() @ x.reshape(-1, x.shape[-1]))
        grad_bias = flat_grad.sum(0) if ctx.has_bias else None
        return grad_x, None, grad_bias


class Fp8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose weight is an fp8 param (see the module docstring); bias unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Fp8LinearFunction.apply(x, self.weight, self.bias)


def _default_filter(name: str, module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 2:
        return False
    return not getattr(weight, "is_embedding_or_output_parameter", False)


def convert(model: torch.nn.Module, recipe: str = "tensorwise", dtype: torch.dtype = torch.float8_e4m3fn,
            modules: Optional[Callable[[str, torch.nn.Module], bool]] = None, *, margin: int = 0,
            amax_history_len: int = 1, amax_compute_algo: str = "most_recent",
            grad_dtype: torch.dtype = torch.float32) -> list[str]:
    """Turn the weights of chosen ``nn.Linear`` layers of ``model`` into fp8 params, in place.

    ``modules(name, module) -> bool`` chooses among the ``nn.Linear`` layers; the default takes every
    2-D Linear weight not marked ``is_embedding_or_output_parameter``. Each chosen layer becomes an
    :class:`Fp8Linear` whose weight holds ``quantize(w, scale)`` with ``scale`` from the weight's own amax
    (both recipes start so; the delayed recipe records that amax as its first history entry), plus a
    ``main_grad`` of ``grad_dtype`` that backward accumulates into. Biases and all other params keep their
    dtype. ``margin``, ``amax_history_len`` and ``amax_compute_algo`` are Megatron-Core's ``fp8_margin``,
    ``fp8_amax_history_len`` and ``fp8_amax_compute_algo``; the optimizer's config must match them.
    Returns the names of the converted layers.
    """
    fp8_max(dtype)  # validates the dtype
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}: must be one of {', '.join(map(repr, RECIPES))}")
    if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"amax_compute_algo={amax_compute_algo!r}: must be one of "
                         f"{', '.join(map(repr, AMAX_COMPUTE_ALGOS))}")
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin={margin!r}: must be an integer >= 0")
    if isinstance(amax_history_len, bool) or not isinstance(amax_history_len, int) or amax_history_len < 1:
        raise ValueError(f"amax_history_len={amax_history_len!r}: must be an integer >= 1")
    if recipe == "tensorwise" and amax_history_len != 1:
        raise ValueError("amax_history_len applies to the delayed recipe only: leave it 1 with 'tensorwise'")
    choose = modules or _default_filter
    owners: dict[int, list[str]] = {}  # param id -> every name it is registered under (tied weights)
    for param_name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(param_name)
    chosen = [(name, module) for name, module in model.named_modules()
              if type(module) is torch.nn.Linear and not is_fp8(module.weight) and choose(name, module)]
    for name, module in chosen:  # all checks before any change: a refused call leaves the model as it was
        if len(owners.get(id(module.weight), [])) > 1:
            raise ValueError(f"fp8.convert: the weight of '{name}' is shared "
                             f"({', '.join(owners[id(module.weight)])}); converting it would untie it. "
                             "Leave it out with modules=...")
    converted = []
    for name, module in chosen:
        weight = module.weight
        values = weight.detach().to(torch.float32)
        first_amax = amax(values)
        scale = scale_from_amax(first_amax, dtype, margin)
        history = torch.zeros(amax_history_len, dtype=torch.float32, device=values.device)
        history[0] = first_amax
        meta = Fp8Meta(recipe, dtype, scale, torch.reciprocal(scale), history, margin, amax_compute_algo)
        param = torch.nn.Parameter(quantize(values, scale, dtype), requires_grad=weight.requires_grad)
        for attr, value in vars(weight).items():  # keep markers such as is_embedding_or_output_parameter
            setattr(param, attr, value)
        param.fp8_meta = meta
        param.main_grad = torch.zeros(weight.shape, dtype=grad_dtype, device=values.device)
        module.weight = param
        # The same tensors as module buffers, so model.state_dict() holds a complete fp8 weight (bytes and
        # scales) and load_state_dict copies into them in place.
        module.register_buffer("weight_scale", meta.scale)
        module.register_buffer("weight_scale_inv", meta.scale_inv)
        module.register_buffer("weight_amax_history", meta.amax_history)
        module.__class__ = Fp8Linear
        converted.append(name)
    if not converted:
        raise ValueError("fp8.convert: no nn.Linear layer was chosen (the default skips embedding/output "
                         "weights): pass modules=lambda name, module: ... to choose")
    return converted
