"""torch's ``GradScaler`` stepping the engine, through the protocol torch's fused optimizers use.

An optimizer with ``_step_supports_amp_scaling`` is not unscaled by ``GradScaler.step(opt)``: for the one
``step()`` call it sets two attributes instead, ``opt.grad_scale`` (the scaler's scale, a device tensor, or
None when ``scaler.unscale_(opt)`` already unscaled the grads in place) and ``opt.found_inf`` (a device
tensor, non-zero when the scaler's check saw an inf or NaN grad). The engine takes both into the step's
static tensors before the (captured) step, on the device and without a host read:

- ``inv_loss_scale`` = 1 / scale, computed as ``GradScaler.unscale_`` computes its own (fp64 reciprocal,
  rounded to fp32), so the norm is unscaled and the unscale folded into the update's grad scale as for
  graphstep's own loss scale; 1 when the grads are unscaled already;
- ``amp_found_inf_nan`` = NaN when ``found_inf`` is set, else 0: the norm stage adds it to the sum of
  squares before the norm's all-reduce, so the step is skipped on every rank alike.

``scaler.unscale_(opt)`` rewrites the grads with ``torch._amp_foreach_non_finite_check_and_unscale_``,
which bumps no version counter: the folded norm would keep the sums of the scaled grads. A step told the
grads were unscaled (``grad_scale`` None) has every folded sum computed again first.

graphstep's own loss scale (``fp16=True`` or ``loss_scale``) and torch's never both apply: a step under a
GradScaler on an engine that scales the loss itself is refused before anything changes.
"""

from __future__ import annotations

import torch

_ABSENT = object()


class TorchGradScaler:
    """The engine's side of the protocol: ``take`` before each step."""

    def __init__(self, tensors, own_scaler: bool):
        self._tensors = tensors
        self._own_scaler = own_scaler
        self._written = False  # the static tensors hold a GradScaler's values (reset once it is gone)
        self.scaled = False
        """Host flag: this step's grads come scaled by the GradScaler (the update must then divide them)."""

    def take(self, attributes: dict) -> bool:
        """Read ``grad_scale`` / ``found_inf`` from the optimizer's ``attributes`` (its ``__dict__``) into the
        step's tensors. Returns whether torch unscaled the grads in place, unseen by their version counters."""
        grad_scale = attributes.get("grad_scale", _ABSENT)
        found_inf = attributes.get("found_inf", _ABSENT)
        t = self._tensors
        if grad_scale is _ABSENT and found_inf is _ABSENT:
            if self._written:  # a step without the GradScaler: back to no scale, nothing reported
                t.inv_loss_scale.fill_(1.0)
                t.amp_found_inf_nan.zero_()
                self._written = self.scaled = False
            return False
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
        reported = found_inf.to(t.amp_found_inf_nan.device).reshape(())
        t.amp_found_inf_nan.zero_().masked_fill_(reported != 0, float("nan"))
        if grad_scale is None:  # scaler.unscale_(opt) ran: the grads are unscaled already
            t.inv_loss_scale.fill_(1.0)
        else:
            t.inv_loss_scale.copy_(grad_scale.to(t.inv_loss_scale.device, torch.float64).reshape(()).reciprocal())
        self._written, self.scaled = True, grad_scale is not None
        return grad_scale is None
