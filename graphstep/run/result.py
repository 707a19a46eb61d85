"""What ``opt.step()`` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class StepResult:
    """What a step reports, as device tensors (no host sync). They are static and overwritten by the
    next step: clone what you keep, read ``.item()`` only where you want the sync."""

    update_successful: torch.Tensor  # bool
    grad_norm: torch.Tensor  # fp32, unscaled global L2 norm before clipping
    num_zeros: Optional[torch.Tensor]  # int64 count of zero grads, or None
    loss_scale: torch.Tensor  # fp32, the scale the next backward uses
    skipped_steps: torch.Tensor  # int64, the steps skipped (non-finite grads, skip threshold) since the build
