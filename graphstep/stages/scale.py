"""Loss-scale update from this step's ``found_inf`` (dynamic scaling), and the step's result flags."""

import torch

from . import Stage


def build(ctx) -> Stage:
    t = ctx.tensors
    scaler = ctx.scaler

    def apply() -> None:
        if scaler is not None:
            scaler.update(t.found_inf)
        t.update_successful.copy_(t.found_inf == 0)

    return Stage("scale", apply)
