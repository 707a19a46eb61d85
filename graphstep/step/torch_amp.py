"""torch's ``GradScaler`` stepping the engine, through the protocol torch's fused optimizers use.

With ``_step_supports_amp_scaling``, ``GradScaler.step(opt)`` does not unscale: it sets ``opt.grad_scale`` (None
when ``unscale_`` already ran) and ``opt.found_inf`` for the one ``step()``. The engine takes both into the step's
static tensors on the device, without a host read: ``inv_loss_scale`` (computed as ``unscale_`` computes its own)
and ``amp_found_inf_nan``, NaN added to the norm's sum before its all-reduce, so every rank skips alike.
``unscale_`` bumps no version counter, so a step told the grads were unscaled folds every sum again first.
Where the scale differs from the one the backward's folds went by, the sums are folded again; a scale more than
2**GUARD_EXPONENT away (set by hand between steps) skips the step (graphstep/step/norm_prescale.py).
graphstep's own loss scale and torch's never both apply: that step is refused before anything changes.
"""

from __future__ import annotations

import torch

from .norm_prescale import FromScale, far_from

_ABSENT = object()


class TorchGradScaler:
    """The engine's side of the protocol: ``copy_scale_and_inf_flag`` before each step."""

    def __init__(self, tensors, own_scaler: bool):
        self._tensors = tensors
        self._own_scaler = own_scaler
        self._written = False  # the static tensors hold a GradScaler's values (reset once it is gone)
        self.scaled = False
        """Host flag: this step's grads come scaled by the GradScaler (the update must then divide them)."""
        self._prescale_from_scale = FromScale(tensors.norm_prescale, tensors.inv_loss_scale)
        self._prescale = tensors.norm_prescale[0]  # the power of two the last backward's folds divided by

    def copy_scale_and_inf_flag(self, attributes: dict) -> bool:
        """Read ``grad_scale`` / ``found_inf`` from the optimizer's ``attributes`` (its ``__dict__``) into the
        step's tensors. Returns whether every folded sum must be computed again: torch unscaled the grads in
        place, unseen by their version counters, or the norm's prescale changed since backward folded."""
        grad_scale = attributes.get("grad_scale", _ABSENT)
        found_inf = attributes.get("found_inf", _ABSENT)
        t = self._tensors
        if grad_scale is _ABSENT and found_inf is _ABSENT:
            refold = self.scaled  # backward folded by the last GradScaler step's prescale
            if self._written:  # a step without the GradScaler: back to no scale, nothing reported
                t.inv_loss_scale.fill_(1.0)
                t.amp_found_inf_nan.zero_()
                self._written = self.scaled = False
            if refold:
                self._prescale_from_scale()  # scale 1's
            return refold
        if self._own_scaler:
            raise RuntimeError(
                "graphstep: torch's GradScaler is stepping an optimizer that scales the loss itself (fp16=True, or "
                "loss_scale set): the grads would be unscaled twice. Either drop the GradScaler and write "
                "opt.scale_loss(loss).backward(); opt.step() (graphstep's dynamic loss scale, decided on the "
                "device), or keep the GradScaler and build with fp16=False and loss_scale=None (the model may "
                "still run in fp16 under torch.autocast)")
        if not isinstance(found_inf, torch.Tensor):
            raise RuntimeError(
                "graphstep: torch's GradScaler recorded no inf check for this optimizer: it found no .grad on its "
                "params (a model whose half-precision grads accumulate into fp32 main_grad, bf16=True or "
                "fp16=True, exposes none). Use graphstep's own loss scale (fp16=True) instead of a GradScaler")
        reported = found_inf.to(t.amp_found_inf_nan.device).reshape(()) != 0
        if grad_scale is None:  # scaler.unscale_(opt) ran: the grads are unscaled already
            t.inv_loss_scale.fill_(1.0)
        else:
            t.inv_loss_scale.copy_(grad_scale.to(t.inv_loss_scale.device, torch.float64).reshape(()).reciprocal())
        scaled = grad_scale is not None
        # Backward folded by the last step's scale only where that step, too, was scaled by the GradScaler.
        refold = not (self.scaled and scaled)
        if refold:
            self._prescale_from_scale()
        else:  # a scale set by hand far from the last one: the folds may have under- or overflowed
            reported = reported | far_from(self._prescale, t.inv_loss_scale)
        t.amp_found_inf_nan.zero_().masked_fill_(reported, float("nan"))
        self._written, self.scaled = True, scaled
        return refold
