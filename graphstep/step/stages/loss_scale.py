"""The loss-scale update and the step's result flags, with the run's count of skipped steps (a device counter:
a loop reads it once, where it already syncs, instead of each step's flag).

The scaler reacts to non-finite grads only (``nonfinite``), like Megatron-Core's: a step skipped by
``grad_norm_skip_threshold`` with finite grads leaves the dynamic loss scale as a clean step would.
"""

from __future__ import annotations

from typing import Optional

from . import Stage, StepTensors


def build_over(scaler: Optional[object], t: StepTensors, compiled: bool = False) -> Stage:
    """``compiled``: the scaler's rule as one compiled graph (graphstep/step/compiled_scalar_math.py)."""
    def apply() -> None:
        if scaler is not None:
            scaler.update(t.nonfinite, compiled=compiled)
        t.update_successful.copy_(t.found_inf == 0)
        t.skipped_steps.add_(t.found_inf != 0)

    return Stage("loss_scale", apply)


def build(ctx) -> Stage:
    return build_over(ctx.scaler, ctx.tensors, ctx.compile_scalars)
