"""The step as a chain of stages over static buffers, all on device.

A stage is built once by a factory ``build(ctx) -> Stage`` (its *init*: it allocates whatever static
tensors it needs and precomputes views) and then applied every step (its *apply*: device work only, no
host reads, conditionals as arithmetic). ``chain`` runs stages in order; the engine's eager path, its
debugging mode and a capture all run the very same ``apply`` functions (DESIGN.md law 4).

The default chain, single process::

    unscale (inf check + global norm, one read of the grads) → zeros (optional) → clip (coefficient,
    skip threshold, folded grad scale) → update (fused kernel, copy-back) → scale (loss-scale update)
    → result

With several data-parallel ranks ``reduce`` (reduce-scatter) runs first and ``gather`` (all-gather) after
the update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


@dataclass(frozen=True)
class Stage:
    name: str
    apply: Callable[[], None]


@dataclass
class StepTensors:
    """Every scalar the step reads or writes, allocated once at build (their addresses never change)."""

    step: torch.Tensor  # fp32 step count, advanced only by successful steps
    found_inf: torch.Tensor  # fp32, 1.0 when this step is skipped
    grad_norm: torch.Tensor  # fp32, the unscaled global L2 norm
    clip_coef: torch.Tensor  # fp32, in (0, 1]
    grad_scale: torch.Tensor  # fp32, what the kernel divides grads by: loss scale / clip coefficient
    update_successful: torch.Tensor  # bool
    loss_scale: torch.Tensor  # fp32, the scale of the next backward (ones without a scaler)
    inv_loss_scale: torch.Tensor  # fp32, 1 / the scale of this step's backward
    num_zeros: Optional[torch.Tensor]  # int64, or None when not counted

    @staticmethod
    def allocate(device, loss_scale: Optional[torch.Tensor], inv_loss_scale: Optional[torch.Tensor],
                 count_zeros: bool) -> "StepTensors":
        def scalar(value=0.0, dtype=torch.float32):
            return torch.full((), value, dtype=dtype, device=device)

        return StepTensors(
            step=scalar(), found_inf=scalar(), grad_norm=scalar(), clip_coef=scalar(1.0),
            grad_scale=scalar(1.0), update_successful=scalar(True, torch.bool),
            loss_scale=loss_scale if loss_scale is not None else scalar(1.0),
            inv_loss_scale=inv_loss_scale if inv_loss_scale is not None else scalar(1.0),
            num_zeros=scalar(0, torch.int64) if count_zeros else None)


def chain(stages: Sequence[Stage], ranges: Optional[Callable[[str], object]] = None) -> Callable[[], None]:
    """One callable applying ``stages`` in order: the function a capture records.

    ``ranges`` (e.g. ``capture.profile.Ranges``) wraps each stage in a named profiler range; the engine
    keeps a plain chain for capture and a ranged one for profiled eager steps, so the plain step carries
    no profiling cost at all.
    """
    applies = tuple(stage.apply for stage in stages)
    if ranges is None:
        def step() -> None:
            for apply in applies:
                apply()
        return step

    named = tuple((f"graphstep.{stage.name}", stage.apply) for stage in stages)

    def ranged_step() -> None:
        for name, apply in named:
            with ranges(name):
                apply()

    return ranged_step
