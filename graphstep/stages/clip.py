"""Clip coefficient, norm-based skip, and the grad scale the update divides the grads by.

A norm above ``grad_norm_skip_threshold`` skips the step (``found_inf``) without counting as non-finite:
the loss scaler sees only ``nonfinite`` (stages/loss_scale.py).

``coef = min(1, clip_grad / (norm + 1e-6))`` (Megatron-Core's and torch's clip_grad_norm_ rule) when
``clip_grad > 0``, else 1; both thresholds are device tensors, so a schedule may change them. The kernel
divides grads by ``loss_scale / coef``: unscaling and clipping happen inside the update's single pass.
"""

from __future__ import annotations

import torch

from . import Stage


def build(ctx) -> Stage:
    t = ctx.tensors
    clip_grad = ctx.hyper.tensor("clip_grad")
    skip_threshold = ctx.hyper.tensor("grad_norm_skip_threshold")
    inv_loss_scale = t.inv_loss_scale
    one = torch.ones_like(t.clip_coef)  # the coefficient without clipping

    # Results go straight into the step's tensors (``out=``): each 0-d op costs a few µs of dispatch on the
    # CPU, several times that right after a backward, and a copy per result would double them.
    def apply() -> None:
        clip = clip_grad.to(torch.float32)
        coef = (clip / (t.grad_norm + 1e-6)).clamp(max=1.0)
        torch.where(clip > 0, coef, one, out=t.clip_coef)
        too_large = t.grad_norm > skip_threshold.to(torch.float32)
        torch.maximum(t.found_inf, too_large, out=t.found_inf)
        torch.reciprocal(inv_loss_scale * t.clip_coef, out=t.grad_scale)

    return Stage("clip", apply)
