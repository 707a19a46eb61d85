"""AdEMAMix's update over lists of flat views, every hyperparameter a device tensor, skip by ``torch.where``.

The rule (Pagliardini, Ablin, Grangier, arXiv:2409.03137, Algorithm 1), decoupled weight decay λ on the old params:

    m1 ← β1·m1 + (1 − β1)·g          m̂1 = m1 / (1 − β1^t)
    m2 ← β3·m2 + (1 − β3)·g
    ν  ← β2·ν  + (1 − β2)·g²          ν̂  = ν / (1 − β2^t)
    θ  ← θ − lr·((m̂1 + α·m2) / (√ν̂ + ε) + λ·θ)

written op for op as these equations (no lerp / addcmul rewriting), so a plain-torch transcription with Python
floats is bitwise this kernel on the CPU (tests/test_ademamix.py). α and β3 are read from the device like lr, so
their warm-up schedules need no recapture. ``grad_scale`` (0-d, or None for 1) divides the grads, which are only
read; ``found_inf`` (0-d fp32, 1.0 = skip) leaves params and all three states bitwise unchanged; ``step`` counts
this step. Under ``kernel="compiled"`` the family runs the compiled twin (compiled_ademamix.py) instead.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

LIVE_FIELDS = frozenset({"lr", "beta1", "beta2", "beta3", "alpha", "weight_decay", "eps"})
STATE_NAMES = ("exp_avg", "exp_avg_slow", "exp_avg_sq")  # m1, m2, ν


def compiled_twin():
    """The module that runs this kernel compiled (same signature and declarations), for ``kernel="compiled"``."""
    from . import compiled_ademamix  # lazily: importing it loads graphstep/kernels/compiled.py
    return compiled_ademamix


def ademamix(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
             exp_avg_slows: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *, step: torch.Tensor,
             lr: torch.Tensor, beta1: torch.Tensor, beta2: torch.Tensor, beta3: torch.Tensor, alpha: torch.Tensor,
             weight_decay: torch.Tensor, eps: torch.Tensor, grad_scale: Optional[torch.Tensor],
             found_inf: torch.Tensor) -> None:
    """One AdEMAMix step over each view, in place; see the module docstring for the rule."""
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_slows) == len(exp_avg_sqs):
        raise ValueError(f"ademamix: {len(params)} params, {len(grads)} grads, {len(exp_avgs)} exp_avgs, "
                         f"{len(exp_avg_slows)} exp_avg_slows and {len(exp_avg_sqs)} exp_avg_sqs: pass one of "
                         "each per view")
    keep = found_inf == 0
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    weight1, weight2, weight3 = 1 - beta1, 1 - beta2, 1 - beta3
    for param, grad, m1, m2, nu in zip(params, grads, exp_avgs, exp_avg_slows, exp_avg_sqs):
        if not param.shape == grad.shape == m1.shape == m2.shape == nu.shape:
            raise ValueError(f"ademamix: the param, grad and state views differ in shape: {tuple(param.shape)}, "
                             f"{tuple(grad.shape)}, {tuple(m1.shape)}, {tuple(m2.shape)}, {tuple(nu.shape)}")
        if grad_scale is not None:
            grad = grad / grad_scale
        # Each line is one of the module docstring's products or sums, rounded once, as written there;
        # the in-place forms only reuse this step's temporaries (IEEE + and x commute).
        new_m1 = m1 * beta1
        new_m1 += grad * weight1
        new_m2 = m2 * beta3
        new_m2 += grad * weight3
        new_nu = grad * grad
        new_nu *= weight2
        new_nu += nu * beta2
        denom = new_nu / bias_correction2
        denom.sqrt_()
        denom += eps
        update = new_m1 / bias_correction1
        update += new_m2 * alpha
        update /= denom
        update += param * weight_decay
        update *= lr
        new_param = param - update
        # Skip: the old values where found_inf (written in place: elementwise, each element reads itself).
        torch.where(keep, new_param, param, out=param)
        torch.where(keep, new_m1, m1, out=m1)
        torch.where(keep, new_m2, m2, out=m2)
        torch.where(keep, new_nu, nu, out=nu)
