"""torch's fused multi-tensor kernels (``_fused_adamw_``, ``_fused_adam_``, ``_fused_sgd_``).

One call per param group over a few large flat views reaches the memory-bandwidth floor on the CPU
(docs/design.md §6). The kernels take ``lr``, ``grad_scale`` and ``found_inf`` as tensors but betas, eps,
weight decay and momentum only as floats (their tensor forms decompose into host reads), so those are
baked into a capture; the engine records them at capture and recaptures when they change.
"""

import torch

from .groups import one_call_per_group

LIVE_FIELDS = frozenset({"lr"})


def _float(name, value):
    if not isinstance(value, float):
        raise TypeError(f"fused kernel: {name} must be a Python float, got {type(value).__name__}")
    return value


def adam(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, weight_decay, eps, decoupled,
         grad_scale, found_inf):
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(params, grads, exp_avgs, exp_avg_sqs, [], [step] * len(params), lr=lr,
           beta1=_float("beta1", beta1), beta2=_float("beta2", beta2),
           weight_decay=_float("weight_decay", weight_decay), eps=_float("eps", eps), amsgrad=False,
           maximize=False, grad_scale=grad_scale, found_inf=found_inf)


# torch's fused kernels take one set of hyperparameters per call: one call per param group.
adam_groups = one_call_per_group(adam)


def sgd(params, grads, momentum_buffers, *, lr, weight_decay, momentum, nesterov, grad_scale, found_inf):
    # is_first_step=False always: buffers start at zero, so momentum * 0 + grad equals torch's first-step
    # clone bitwise, and a graph captured on any step replays the same op.
    torch._fused_sgd_(params, grads, list(momentum_buffers), weight_decay=_float("weight_decay", weight_decay),
                      momentum=_float("momentum", momentum), lr=lr, dampening=0.0, nesterov=nesterov,
                      maximize=False, is_first_step=False, grad_scale=grad_scale, found_inf=found_inf)


# What this implementation offers the families (graphstep/kernels/__init__.py): entry point -> function.
ENTRY_POINTS = dict(adam=adam, adam_groups=adam_groups, sgd=sgd)
