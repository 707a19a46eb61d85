"""The app's ``--precision`` choices: the OptimizerConfig flags and model preparation of each, and for fp8
the param bytes the engine actually allocated.

- fp32: fp32 params, no main params.
- bf16 / fp16: half-precision params with fp32 main params (fp16 adds dynamic loss scaling).
- fp8: the hidden Linear weights become fp8 params (``graphstep.fp8.convert``, current "tensorwise"
  scaling, e4m3) requantized inside the step; every other param trains in bf16, all with fp32 main
  params. Embedding and output weights stay bf16 (the built-in GPT marks them
  ``is_embedding_or_output_parameter``, which ``convert``'s default filter skips).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

import graphstep as gs

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_RECIPE = "tensorwise"
FP8_DTYPE = torch.float8_e4m3fn


def config_flags(precision: str, *, initial_loss_scale: float = 2.0 ** 16) -> dict:
    """OptimizerConfig keyword arguments for ``precision``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {', '.join(PRECISIONS)}")
    return {"fp32": {}, "bf16": {"bf16": True}, "fp8": {"bf16": True, "fp8_recipe": FP8_RECIPE},
            "fp16": {"fp16": True, "initial_loss_scale": initial_loss_scale}}[precision]


@contextlib.contextmanager
def cast_by_the_optimizer():
    """Around the app's get_optimizer: the cast of the built-in model to bf16 / fp16 is its ``--precision``,
    which the app reports itself, so the engine's build-time note about casting a user's model is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="graphstep: .* casts the model's params")
        yield


def prepare(model: torch.nn.Module, precision: str) -> list[str]:
    """Convert ``model``'s hidden Linear weights to fp8 when ``precision`` is "fp8" (after the model is on
    its device: the scales live there); returns the converted layers' names ([] otherwise). The other
    params are cast to bf16 by the optimizer at build (``bf16=True``)."""
    if precision != "fp8":
        return []
    return gs.fp8.convert(model, recipe=FP8_RECIPE, dtype=FP8_DTYPE, modules=_fp8_layers)


def _fp8_layers(name: str, module: torch.nn.Module) -> bool:
    # convert's default (2-D, not embedding/output), minus weights that QK-clip registered by identity:
    # converting would replace the registered Parameter object.
    weight = module.weight
    return weight.dim() == 2 and not getattr(weight, "is_embedding_or_output_parameter", False) and \
        not any("qk_clip" in attr for attr in vars(weight))


@dataclass(frozen=True)
class ParamBytes:
    """Bytes of the model's params as the optimizer allocated them (its flat param buffers, padding
    included), split by kind, against what the same params would take all in bf16."""

    fp8_elements: int
    fp8_bytes: int  # storage bytes of the fp8 param buffers (1 B/element + alignment padding)
    scale_bytes: int  # scale, scale_inv and amax history of every fp8 weight
    scale_tensors: int
    other_bytes: int  # the non-fp8 param buffers (bf16)
    all_bf16_bytes: int  # 2 B for every param element

    @property
    def total(self) -> int:
        return self.fp8_bytes + self.scale_bytes + self.other_bytes

    def summary(self) -> str:
        mb = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
        return (f"param bytes: {mb(self.total)} = fp8 weights {mb(self.fp8_bytes)} ({self.fp8_elements:,} "
                f"elements at 1 B, padding included) + {self.scale_tensors} fp8 scale tensors "
                f"{self.scale_bytes:,} B + other params (bf16) {mb(self.other_bytes)}; all in bf16: "
                f"{mb(self.all_bf16_bytes)} ({self.total / self.all_bf16_bytes:.2f}x)")


def param_bytes(opt) -> ParamBytes:
    """Measure ``opt``'s param storages (``untyped_storage().nbytes()``), not a formula."""
    fp8_bytes = other = 0
    for flat in opt.buffers.param_flat:
        if flat.dtype in gs.fp8.FP8_DTYPES:
            fp8_bytes += flat.untyped_storage().nbytes()
        else:
            other += flat.untyped_storage().nbytes()
    weights = [p for p in opt.buffers.params if gs.fp8.is_fp8(p)]
    scales = [t for p in weights for t in (p.fp8_meta.scale, p.fp8_meta.scale_inv, p.fp8_meta.amax_history)]
    return ParamBytes(fp8_elements=sum(p.numel() for p in weights), fp8_bytes=fp8_bytes,
                      scale_bytes=sum(t.untyped_storage().nbytes() for t in scales), scale_tensors=len(scales),
                      other_bytes=other, all_bf16_bytes=2 * sum(p.numel() for p in opt.buffers.params))
