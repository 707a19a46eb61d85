"""Reference update math: plain tensor ops, every hyperparameter a device tensor, skip by ``torch.where``.

The test oracle for the fused kernels, and the implementation that never bakes a hyperparameter into a
capture. It follows the operation order of torch.optim's single-tensor Adam/SGD.
"""

import torch

from .groups import one_call_per_group

LIVE_FIELDS = frozenset({"lr", "weight_decay", "beta1", "beta2", "eps", "momentum"})


def _unscale(grad, grad_scale, keep):
    # Like torch's fused kernels, leave the grads divided by grad_scale when the step is applied.
    if grad_scale is None:
        return grad
    unscaled = grad / grad_scale
    grad.copy_(torch.where(keep, unscaled, grad))
    return unscaled


def adam(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, weight_decay, eps, decoupled,
         grad_scale, found_inf):
    keep = found_inf == 0
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step).sqrt()
    step_size = lr / bias_correction1
    for param, grad_in, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs):
        grad = _unscale(grad_in, grad_scale, keep)
        if decoupled:
            new_param = param * (1 - lr * weight_decay)
        else:
            grad = grad + weight_decay * param
            new_param = param
        new_exp_avg = exp_avg.lerp(grad, 1 - beta1)
        # addcmul/addcdiv with the scalar folded into one factor round exactly as torch's mul_/addcmul_/
        # addcdiv_(value=...) chain does, while the scalars stay device tensors.
        new_exp_avg_sq = torch.addcmul(exp_avg_sq * beta2, (1 - beta2) * grad, grad)
        denom = new_exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
        new_param = torch.addcdiv(new_param, -step_size * new_exp_avg, denom)
        param.copy_(torch.where(keep, new_param, param))
        exp_avg.copy_(torch.where(keep, new_exp_avg, exp_avg))
        exp_avg_sq.copy_(torch.where(keep, new_exp_avg_sq, exp_avg_sq))


adam_groups = one_call_per_group(adam)


def sgd(params, grads, momentum_buffers, *, lr, weight_decay, momentum, nesterov, grad_scale, found_inf):
    keep = found_inf == 0
    buffers = momentum_buffers if momentum_buffers else [None] * len(params)
    for param, grad_in, buf in zip(params, grads, buffers):
        grad = _unscale(grad_in, grad_scale, keep) + weight_decay * param
        if buf is not None:
            # Buffers start at zero, so the first step gives buf = grad, as torch's clone-on-first-step does.
            new_buf = buf * momentum + grad
            grad = grad + momentum * new_buf if nesterov else new_buf
            # Momentum 0 (a schedule's) leaves the buffer as it is, as torch's SGD does: the step is plain SGD.
            buf.copy_(torch.where(keep & (momentum != 0), new_buf, buf))
        param.copy_(torch.where(keep, param - lr * grad, param))


# What this implementation offers the families (graphstep/kernels/__init__.py): entry point -> function.
ENTRY_POINTS = dict(adam=adam, adam_groups=adam_groups, sgd=sgd)
