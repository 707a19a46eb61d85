"""fp8 scaling math: per-tensor scales, the saturating cast, and both recipes' updates.

Pure tensor functions, capturable: no host reads, every conditional a ``torch.where``, every scalar a 0-d fp32
tensor. The rules are Transformer Engine's per-tensor recipes as Megatron-Core uses them
(``scale = fp8_max / amax / 2**margin``; "tensorwise" scales from this amax, "delayed" casts with the previous
scale and keeps an amax history). The cast clamps to ``±fp8_max`` before converting, because torch's e5m2 cast
turns an overflow into inf. The caller owns communication: it MAX-reduces a sharded tensor's amax before
``scale_from_amax``. A skipped step (``found_inf`` = 1) leaves data, scales and history bitwise unchanged.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
RECIPES = ("tensorwise", "delayed")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
_FP32_MAX = torch.finfo(torch.float32).max


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    try:
        return FP8_MAX[dtype]
    except KeyError:
        raise ValueError(f"{dtype} is not an fp8 dtype graphstep supports: use torch.float8_e4m3fn or "
                         "torch.float8_e5m2") from None


def amax(values: torch.Tensor) -> torch.Tensor:
    """max |values| as a 0-d fp32 tensor (NaN if any value is NaN; 0 for an empty tensor)."""
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=values.device)
    return values.abs().amax().to(torch.float32)


def scale_from_amax(amax_value: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """``fp8_max / amax / 2**margin`` with amax 0/inf/NaN → 1 and an infinite scale → largest fp32."""
    # A tensor numerator: ``448 / t`` would be computed as t.reciprocal() * 448, a second rounding.
    scale = torch.full_like(amax_value, fp8_max(dtype)) / amax_value / float(2 ** margin)
    scale = scale.clamp(max=_FP32_MAX)  # +inf (tiny amax) → largest finite; NaN passes through to the where
    usable = torch.isfinite(amax_value) & (amax_value != 0)
    return torch.where(usable, scale, torch.ones_like(scale))


def quantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values * scale`` clamped to ±fp8_max, then cast to ``dtype`` (round to nearest even)."""
    limit = fp8_max(dtype)
    scaled = torch.mul(values.to(torch.float32), scale)  # a fresh fp32 tensor: clamped in place (one pass less)
    return scaled.clamp_(-limit, limit).to(dtype)


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale_inv`` in fp32, then cast to ``dtype``."""
    return (data.to(torch.float32) * scale_inv).to(dtype)


def _keep_if_skipped(found_inf: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    skipped = found_inf > 0
    if old.dtype in FP8_DTYPES:  # torch.where has no fp8 kernels: select the bytes
        return torch.where(skipped, old.view(torch.uint8), new.view(torch.uint8)).view(old.dtype)
    return torch.where(skipped, old, new)


def _select_bytes_into(data: torch.Tensor, found_inf: torch.Tensor, new_data: torch.Tensor) -> None:
    """``data`` ← its own bytes when skipped, else ``new_data``'s: one pass, written in place (``torch.where``
    has no fp8 kernels, so the bytes are selected as uint8; each element reads then writes its own slot)."""
    bytes_view = data.view(torch.uint8)
    torch.where(found_inf > 0, bytes_view, new_data.view(torch.uint8), out=bytes_view)


def requantize_current(values: torch.Tensor, amax_value: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                       scale_inv: torch.Tensor, found_inf: torch.Tensor, margin: int = 0) -> None:
    """Tensorwise recipe, in place: scale from ``amax_value`` (already MAX-reduced by the caller), cast
    ``values`` into ``data`` with it, ``scale_inv = 1 / scale``. All unchanged when ``found_inf`` is 1."""
    new_scale = scale_from_amax(amax_value, data.dtype, margin)
    _select_bytes_into(data, found_inf, quantize(values, new_scale, data.dtype))
    scale.copy_(_keep_if_skipped(found_inf, scale, new_scale))
    scale_inv.copy_(_keep_if_skipped(found_inf, scale_inv, torch.reciprocal(new_scale)))


def scale_from_history(history: torch.Tensor, dtype: torch.dtype, margin: int, algo: str) -> torch.Tensor:
    """The delayed recipe's next scale: from the history's max, or its most recent entry (index 0)."""
    if algo == "max":
        chosen = history.amax()
    elif algo == "most_recent":
        chosen = history[0]
    else:
        raise ValueError(f"amax_compute_algo={algo!r}: must be one of {', '.join(map(repr, AMAX_COMPUTE_ALGOS))}")
    return scale_from_amax(chosen, dtype, margin)


def requantize_delayed(values: torch.Tensor, amax_value: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                       scale_inv: torch.Tensor, history: torch.Tensor, found_inf: torch.Tensor, margin: int = 0,
                       algo: str = "most_recent") -> None:
    """Delayed recipe, in place: cast ``values`` with the current ``scale``, ``scale_inv = 1 / scale``,
    push ``amax_value`` (already MAX-reduced by the caller) into ``history`` (newest at index 0), then
    ``scale`` ← the next scale from the history. All unchanged when ``found_inf`` is 1."""
    _select_bytes_into(data, found_inf, quantize(values, scale, data.dtype))
    new_scale_inv = torch.reciprocal(scale)
    new_history = torch.cat([amax_value.reshape(1), history[:-1]])
    new_scale = scale_from_history(new_history, data.dtype, margin, algo)
    scale_inv.copy_(_keep_if_skipped(found_inf, scale_inv, new_scale_inv))
    history.copy_(_keep_if_skipped(found_inf, history, new_history))
    scale.copy_(_keep_if_skipped(found_inf, scale, new_scale))
