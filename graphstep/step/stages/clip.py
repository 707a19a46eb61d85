"""Clip coefficient, norm-based skip, and the grad scale the update divides the grads by.

A norm above ``grad_norm_skip_threshold`` skips the step (``found_inf``) without counting as non-finite:
the loss scaler sees only ``nonfinite`` (stages/loss_scale.py).

``coef = min(1, clip_grad / (norm + 1e-6))`` (Megatron-Core's and torch's clip_grad_norm_ rule) when
``clip_grad > 0``, else 1; both thresholds are device tensors, so a schedule may change them. The kernel
divides grads by ``grad_scale = loss_scale / coef``: unscaling and clipping happen inside the update's single
pass. Under a loss scale near fp32's top that factor can overflow (inf here); the update then splits it into a
power of two it divides the grads by first and a finite rest for the kernel (stages/grad_prescale.py).
The math is one scalar graph (graphstep/step/compiled_scalar_math.py): compiled where the step compiles its scalars.
"""

from __future__ import annotations

import torch

from .. import compiled_scalar_math
from ..compiled_scalar_math import scalar
from . import Stage, grad_prescale


# Results go straight into the step's tensors (``out=``): eagerly each 0-d op costs a few µs of dispatch on
# the CPU, several times that right after a backward, and a copy per result would double them.
def _clip_math(outs, ins) -> None:
    clip_coef, found_inf, grad_scale = outs
    grad_norm, clip_grad, skip_threshold, inv_loss_scale, one = ins
    clip = scalar(clip_grad).to(torch.float32)
    coef = (clip / (grad_norm + 1e-6)).clamp(max=1.0)
    torch.where(clip > 0, coef, one, out=clip_coef)
    too_large = grad_norm > scalar(skip_threshold).to(torch.float32)
    torch.maximum(found_inf, too_large, out=found_inf)
    torch.reciprocal(inv_loss_scale * clip_coef, out=grad_scale)


def _clip_split_math(outs, ins) -> None:
    """``_clip_math``, then the grad scale split where it overflows (loss-scaled grads: grad_prescale.py)."""
    _clip_math(outs[:3], ins[:5])
    clip_coef, found_inf, grad_scale, kernel_scale, prescale, untouched = outs
    grad_prescale.split_math(kernel_scale, prescale, untouched, grad_scale, ins[3], clip_coef, found_inf)


_CLIP = compiled_scalar_math.register("clip", _clip_math)
_CLIP_SPLIT = compiled_scalar_math.register("clip_split", _clip_split_math)


def build(ctx) -> Stage:
    t = ctx.tensors
    outs = [t.clip_coef, t.found_inf, t.grad_scale]
    ins = [t.grad_norm, ctx.hyper.tensor("clip_grad"), ctx.hyper.tensor("grad_norm_skip_threshold"),
           t.inv_loss_scale, torch.ones_like(t.clip_coef)]  # the last: the coefficient without clipping
    compiled = ctx.compile_scalars
    split_outs = outs + [t.kernel_grad_scale, t.grad_prescale, t.grad_prescale_off]
    scaled, torch_amp = ctx.scaler is not None, ctx.torch_amp

    def apply() -> None:
        # A host choice the update stage reports as baked (a flip recaptures).
        if scaled or (torch_amp is not None and torch_amp.scaled):
            _CLIP_SPLIT(split_outs, ins, compiled=compiled)
        else:
            _CLIP(outs, ins, compiled=compiled)

    return Stage("clip", apply)
