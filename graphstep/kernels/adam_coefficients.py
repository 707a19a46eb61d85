"""The compiled Adam loop's per-group scalars, computed on the device from the groups' hyperparameters: one row
per group, read by the ``torch.compile``d loop (graphstep/kernels/compiled.py) and the native one
(graphstep/native/adam_element.h, whose enum lists the same positions)."""

from __future__ import annotations

import torch

# Positions in a row.
DECAY, WD, BETA1, ONE_MINUS_BETA1, BETA2, ONE_MINUS_BETA2, BC2_SQRT, EPS, STEP_SIZE, SCALE, KEEP = range(11)


def adam_coefficients(hypers: torch.Tensor, step, grad_scale, found_inf, decoupled: bool) -> torch.Tensor:
    """Each group's row of the loop's scalars (positions ``DECAY`` ... ``KEEP``), in the hyperparameters'
    precision, from the (groups, 5) hyperparameter table (compiled.py, ``_hyper_table``). Traced into the
    compiled update, so these dozen scalar ops are no separate ops (kernels on a GPU) in the step: inductor
    computes them with the loop. On the CPU a call over several groups updates bitwise as one call per group:
    the tests check two groups, and 2-5, 8, 13 and 19 groups (fp64 hyperparameters, both decays) were compared
    once; the native loop computes them as eager ops, bitwise the same (tests/test_native_update.py). On a
    GPU Triton's fp32 division is approximate: the coefficients then differ from eager ops' in the last bits,
    expected within the compiled kernel's drift against torch (tests/test_engine.py; not run on a GPU), the
    same in eager steps and replays."""
    lr, beta1, beta2, weight_decay, eps = hypers.unbind(1)
    step = step.to(hypers.dtype)
    if decoupled:
        decay, coupled_wd = 1 - lr * weight_decay, torch.zeros_like(lr)
    else:
        decay, coupled_wd = torch.ones_like(lr), weight_decay
    scale = torch.ones_like(lr) if grad_scale is None else grad_scale.to(hypers.dtype).expand(len(lr))
    keep = (found_inf == 0).expand(len(lr))
    return torch.stack((decay, coupled_wd, beta1, 1 - beta1, beta2, 1 - beta2, (1 - beta2 ** step).sqrt(), eps,
                        lr / (1 - beta1 ** step), scale, keep), dim=1)
