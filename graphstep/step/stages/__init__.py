"""The step as a chain of stages over static buffers, all on device: the stage contract.

A stage is built once by a factory ``build(ctx) -> Stage`` (its *init*: static tensors and views, from the typed
``StepContext``) and applied every step (its *apply*: device work only, no host reads, conditionals as
arithmetic). Stages talk only through the step's scalars (``StepTensors``) and the static buffers; a factory
never talks to other ranks. A stage that takes host values into the step reports them through ``Stage.baked``,
so a captured step is recaptured when one changes (docs/design.md law 3). The order is graphstep/step/chain.py's:

    [reduce] → norm → [zeros] → clip → update → [qk_clip] → copy_back → [requantize] → [gather] → loss_scale
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .. import norm_prescale


def _no_baked_values() -> tuple:
    return ()


@dataclass(frozen=True)
class Stage:
    name: str
    apply: Callable[[], None]
    baked: Callable[[], tuple] = _no_baked_values
    """The host values this stage bakes into a capture, as ``(where, name, value)`` tuples."""


@dataclass
class StepTensors:
    """Every scalar the step reads or writes, allocated once at build (their addresses never change)."""

    step: torch.Tensor  # fp32 step count, advanced only by successful steps
    nonfinite: torch.Tensor  # fp32, 1.0 when a grad is inf/NaN (what the loss scaler reacts to)
    found_inf: torch.Tensor  # fp32, 1.0 when this step is skipped (non-finite, or over the skip threshold)
    grad_norm: torch.Tensor  # fp32, the unscaled global L2 norm
    clip_coef: torch.Tensor  # fp32, in (0, 1]
    grad_scale: torch.Tensor  # fp32, loss scale / clip coefficient (inf where it overflows: grad_prescale.py)
    kernel_grad_scale: torch.Tensor  # fp32, what the kernel divides loss-scaled grads by: grad_scale, or its rest
    grad_prescale: torch.Tensor  # fp32, a power of two the grads are divided by first where grad_scale overflows
    grad_prescale_off: torch.Tensor  # fp32, 1.0 where the grads are not pre-divided (fused SGD's found_inf)
    norm_prescale: torch.Tensor  # fp32 (5,), what the norm divides the grads by and its factors (norm_prescale.FIELDS)
    update_successful: torch.Tensor  # bool
    loss_scale: torch.Tensor  # fp32, the scale of the next backward (ones without a scaler)
    inv_loss_scale: torch.Tensor  # fp32, 1 / the scale of this step's backward
    amp_found_inf_nan: torch.Tensor  # fp64, 0, or NaN when the caller's check found non-finite grads (torch_amp.py)
    skipped_steps: torch.Tensor  # int64, how many steps were skipped since the build
    num_zeros: Optional[torch.Tensor]  # int64, or None when not counted

    @staticmethod
    def allocate(device, loss_scale: Optional[torch.Tensor] = None, inv_loss_scale: Optional[torch.Tensor] = None,
                 count_zeros: bool = False) -> "StepTensors":
        def scalar(value=0.0, dtype=torch.float32):
            return torch.full((), value, dtype=dtype, device=device)

        return StepTensors(
            step=scalar(), nonfinite=scalar(), found_inf=scalar(), grad_norm=scalar(), clip_coef=scalar(1.0),
            grad_scale=scalar(1.0), kernel_grad_scale=scalar(1.0), grad_prescale=scalar(1.0),
            grad_prescale_off=scalar(1.0), norm_prescale=norm_prescale.unscaled_row(device),
            update_successful=scalar(True, torch.bool),
            loss_scale=loss_scale if loss_scale is not None else scalar(1.0),
            inv_loss_scale=inv_loss_scale if inv_loss_scale is not None else scalar(1.0),
            amp_found_inf_nan=scalar(0.0, torch.float64),
            skipped_steps=scalar(0, torch.int64), num_zeros=scalar(0, torch.int64) if count_zeros else None)

    def named(self) -> dict[str, torch.Tensor]:
        """Every scalar by name (what a capture guards), ``num_zeros`` when counted."""
        names = ("step", "nonfinite", "found_inf", "grad_norm", "clip_coef", "grad_scale", "kernel_grad_scale",
                 "grad_prescale", "grad_prescale_off", "norm_prescale", "update_successful", "loss_scale",
                 "inv_loss_scale", "amp_found_inf_nan", "num_zeros", "skipped_steps")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def chain(stages: Sequence[Stage], ranges=None) -> Callable[[], None]:
    """One callable applying ``stages`` in order: the function a capture records.

    ``ranges`` (``capture.profile.Ranges``): while ``ranges.enabled``, each stage runs inside a named
    profiler range; while it is off the plain loop runs, so an unprofiled step carries no profiling cost.
    The capture always records the chain built without ranges.
    """
    applies = tuple(stage.apply for stage in stages)

    def step() -> None:
        for apply in applies:
            apply()

    if ranges is None:
        return step
    named = tuple((f"graphstep.{stage.name}", stage.apply) for stage in stages)

    def ranged_step() -> None:
        if not ranges.enabled:
            step()
            return
        for name, apply in named:
            with ranges(name):
                apply()

    return ranged_step


def baked_values(stages: Sequence[Stage]) -> Callable[[], tuple]:
    """One callable returning every stage's baked host values, in stage order."""
    reporters = tuple(stage.baked for stage in stages if stage.baked is not _no_baked_values)

    def values() -> tuple:
        return tuple(value for report in reporters for value in report())

    return values
