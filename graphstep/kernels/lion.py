"""Lion's update over lists of flat views, every hyperparameter a device tensor, skip by ``torch.where``.

The rule (Chen et al., arXiv:2302.06675, Algorithm 2), decoupled weight decay on the old params:

    c = β1·m + (1 − β1)·g
    θ ← θ − lr·(sign(c) + wd·θ)
    m ← β2·m + (1 − β2)·g

in the op forms of emerging-optimizers' Lion (Megatron-Core's ``muon_scalar_optimizer="lion"``), so with fp64
hyperparameter tensors this is bitwise its arithmetic on the CPU. ``grad_scale`` (0-d, or None for 1) divides
the grads, which are only read; ``found_inf`` (0-d fp32, 1.0 = skip) leaves params and ``exp_avgs`` bitwise
unchanged. Params and state are fp32.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

LIVE_FIELDS = frozenset({"lr", "beta1", "beta2", "weight_decay"})
STATE_NAMES = ("exp_avg",)


def lion(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor], *,
         lr: torch.Tensor, beta1: torch.Tensor, beta2: torch.Tensor, weight_decay: torch.Tensor,
         grad_scale: Optional[torch.Tensor], found_inf: torch.Tensor) -> None:
    """One Lion step over each view, in place; see the module docstring for the rule."""
    if not len(params) == len(grads) == len(exp_avgs):
        raise ValueError(f"lion: {len(params)} params, {len(grads)} grads and {len(exp_avgs)} exp_avgs: "
                         f"pass one of each per view")
    keep = found_inf == 0
    neg_lr = -lr
    neg_decay = -(weight_decay * lr)
    # lerp wants its tensor weight in the input's dtype (fp32 state); casting the (fp64) 1 − β rounds
    # like the Python float EO passes.
    weight1 = (1 - beta1).to(torch.float32)
    weight2 = (1 - beta2).to(torch.float32)
    for param, grad, exp_avg in zip(params, grads, exp_avgs):
        if param.shape != grad.shape or param.shape != exp_avg.shape:
            raise ValueError(f"lion: param, grad and exp_avg views differ in shape: {tuple(param.shape)}, "
                             f"{tuple(grad.shape)}, {tuple(exp_avg.shape)}")
        if grad_scale is not None:
            grad = grad / grad_scale
        interpolated = exp_avg.lerp(grad, weight1)
        decayed = torch.addcmul(param, neg_decay, param)
        new_param = torch.addcmul(decayed, neg_lr, interpolated.sign())
        new_exp_avg = exp_avg.lerp(grad, weight2)
        param.copy_(torch.where(keep, new_param, param))
        exp_avg.copy_(torch.where(keep, new_exp_avg, exp_avg))
