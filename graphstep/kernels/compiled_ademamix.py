"""AdEMAMix's update as one ``torch.compile``d loop over the views: the compiled twin of
graphstep/kernels/ademamix.py (same signature), run where ``OptimizerConfig.kernel`` is "compiled".

The eager kernel's ops, in its order and roundings, traced into one loop that reads param, grad and the three
states once and writes param and states once. The scalar terms come from one table (a table, not 0-d tensors:
dynamo would read a 0-d fp64 CPU tensor as a Python float behind a guard). Bitwise the eager kernel but for its
square root: the compiled loop's is correctly rounded, torch's CPU ``sqrt`` is not, and the update carries that
last bit on (far inside the drift docs/design.md §8 allows). It runs through compiled.py's machinery, as one
``torch.library`` custom op that capture's replay backend records like any aten op.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import compiled

# The eager kernel's declarations (graphstep/kernels/ademamix.py, which imports this module lazily: the same values,
# pinned equal by tests/test_ademamix.py).
LIVE_FIELDS = frozenset({"lr", "beta1", "beta2", "beta3", "alpha", "weight_decay", "eps"})
STATE_NAMES = ("exp_avg", "exp_avg_slow", "exp_avg_sq")  # m1, m2, ν

_FIELDS = ("lr", "beta1", "beta2", "beta3", "alpha", "weight_decay", "eps")


def _ademamix_loop(param, grad, m1, m2, nu, keep, weight1, weight2, weight3, bias_correction1, bias_correction2,
                   lr, alpha, weight_decay, eps, beta1, beta2, beta3):
    # graphstep/kernels/ademamix.py's ops, one for one.
    new_m1 = m1 * beta1 + grad * weight1
    new_m2 = m2 * beta3 + grad * weight3
    new_nu = grad * grad * weight2 + nu * beta2
    denom = (new_nu / bias_correction2).sqrt() + eps
    update = (new_m1 / bias_correction1 + new_m2 * alpha) / denom
    update = (update + param * weight_decay) * lr
    new_param = param - update
    param.copy_(torch.where(keep, new_param, param))
    m1.copy_(torch.where(keep, new_m1, m1))
    m2.copy_(torch.where(keep, new_m2, m2))
    nu.copy_(torch.where(keep, new_nu, nu))


def _ademamix_views(params, grads, m1s, m2s, nus, hypers, found_inf, grad_scale):
    # Each scalar in fp32 before it meets an fp32 tensor, as eager torch rounds a 0-d fp64 operand (inductor
    # would divide in fp64 and round the quotient).
    beta1, beta2, beta3 = hypers[1], hypers[2], hypers[3]
    weights = torch.stack((1 - beta1, 1 - beta2, 1 - beta3)).to(params[0].dtype)
    scalars = hypers.to(params[0].dtype)
    lr, beta1, beta2, beta3, alpha, weight_decay, eps, bias_correction1, bias_correction2 = scalars.unbind(0)
    weight1, weight2, weight3 = weights.unbind(0)
    keep = found_inf == 0
    for param, grad, m1, m2, nu in zip(params, grads, m1s, m2s, nus):
        if grad_scale is not None:
            grad = grad / grad_scale
        _ademamix_loop(param, grad, m1, m2, nu, keep, weight1, weight2, weight3, bias_correction1,
                       bias_correction2, lr, alpha, weight_decay, eps, beta1, beta2, beta3)


@torch.library.custom_op("graphstep::compiled_ademamix_", mutates_args=("params", "exp_avgs", "exp_avg_slows",
                                                                         "exp_avg_sqs"))
def _ademamix_op(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_slows: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], hypers: torch.Tensor,
                 step: torch.Tensor, grad_scale: Optional[torch.Tensor], found_inf: torch.Tensor) -> None:
    # The bias corrections as the eager kernel computes them: with a 0-d step, torch's pow takes small integer
    # exponents as products (β·β·β for step 3), where a compiled pow calls the C library's, an ulp apart.
    beta1, beta2 = hypers[1], hypers[2]
    table = torch.cat((hypers, torch.stack((1 - beta1 ** step, 1 - beta2 ** step))))
    compiled._run(_ademamix_views, (params, grads, exp_avgs, exp_avg_slows, exp_avg_sqs), table, found_inf,
                  grad_scale, flags=(grad_scale is not None,))


@_ademamix_op.register_fake
def _(params, grads, exp_avgs, exp_avg_slows, exp_avg_sqs, hypers, step, grad_scale, found_inf) -> None:
    return None


def ademamix(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
             exp_avg_slows: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *, step: torch.Tensor,
             lr, beta1, beta2, beta3, alpha, weight_decay, eps, grad_scale: Optional[torch.Tensor],
             found_inf: torch.Tensor) -> None:
    """One AdEMAMix step over each view, in place (graphstep/kernels/ademamix.py's rule and arguments)."""
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_slows) == len(exp_avg_sqs):
        raise ValueError(f"ademamix: {len(params)} params, {len(grads)} grads, {len(exp_avgs)} exp_avgs, "
                         f"{len(exp_avg_slows)} exp_avg_slows and {len(exp_avg_sqs)} exp_avg_sqs: pass one of "
                         "each per view")
    if not params:
        return
    for views in zip(params, grads, exp_avgs, exp_avg_slows, exp_avg_sqs):
        if len({tuple(v.shape) for v in views}) != 1:
            raise ValueError(f"ademamix: the param, grad and state views differ in shape: "
                             f"{', '.join(str(tuple(v.shape)) for v in views)}")
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, beta3=beta3, alpha=alpha, weight_decay=weight_decay, eps=eps)
    like = compiled._precision(lr, params[0].device)
    table = torch.stack(compiled._scalars(*(hyper[name] for name in _FIELDS), like=like))
    flat = [[v.view(-1) for v in views] for views in (params, grads, exp_avgs, exp_avg_slows, exp_avg_sqs)]
    _ademamix_op(*flat, table, step, grad_scale, found_inf)
