"""The update math over lists of flat views, with interchangeable implementations of one signature.

Each optimizer family (graphstep/families/) has one kernel function per implementation module; the
family declares which hyperparameter feeds which argument, the module declares (``LIVE_FIELDS``) which
of them it reads from device tensors. Every implementation module provides::

    adam(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, weight_decay, eps,
         decoupled, grad_scale, found_inf) -> None
    adam_groups(groups, *, step, decoupled, grad_scale, found_inf) -> None
        several param groups at once, each (params, grads, exp_avgs, exp_avg_sqs, {lr, beta1, beta2,
        weight_decay, eps}): one compiled call for all of them, else one ``adam`` call per group
    sgd(params, grads, momentum_buffers, *, lr, weight_decay, momentum, nesterov,
        grad_scale, found_inf) -> None
    LIVE_FIELDS: frozenset of the hyperparameters it reads from device tensors

All updates are in place. ``grad_scale`` (0-d fp32, or None for 1) divides the grads: it folds
loss-scale unscaling and the clip coefficient into the update, so no separate pass rewrites the grads.
The fused and reference kernels leave the grads divided by ``grad_scale`` on an applied step, as torch's
fused kernels do; the compiled kernel leaves them as they were (not writing them saves 4 B per param):
after the step the grads are spent, to be zeroed. ``found_inf`` (0-d fp32, 1.0 = skip) leaves params and
state bitwise unchanged. Hyperparameters in ``LIVE_FIELDS`` are 0-d device tensors;
the others are Python floats, which a capture bakes in (the engine guards them and recaptures on change).
``momentum_buffers`` is empty when momentum is 0.

``OptimizerConfig.kernel="auto"`` (the default) is not a module but a choice between two of them, made
once at build (kernels/auto.py).
"""

from types import ModuleType

import torch

from . import auto, compiled, fused, reference

IMPLEMENTATIONS = {"fused": fused, "compiled": compiled, "reference": reference}


def get_kernels(name: str) -> ModuleType:
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(f"kernel={name!r}: must be one of {', '.join(map(repr, IMPLEMENTATIONS))}") from None


def choose_kernels(config, device, families, comm=None, hyper_dtype=None,
                   numel=None, like=None) -> tuple[ModuleType, "auto.KernelChoice"]:
    """The implementation module ``config.kernel`` means on ``device`` ("auto" resolved), and why. ``comm``
    (graphstep.parallel.collectives.Collectives): with several data-parallel ranks, "auto" is agreed across them
    (``auto.agree``: a build-time collective), and so is the refusal of a "compiled" that fails anywhere. ``hyper_dtype``: the step's hyperparameter dtype, which "auto"
    probes the compiled kernel with (float64 if None). ``numel``: elements this rank's update covers. ``like``:
    the step's ``auto.StepShape``, for a probe that compiles the step's own variant."""
    # A family with a kernels module of its own needs the configured one only where it has a compiled twin.
    needs_kernel = any(family.kernels is None or hasattr(family.kernels, "compiled_twin") for family in families)
    hyper_dtype = hyper_dtype or torch.float64
    several = comm is not None and comm.dp_size > 1
    if config.kernel == "compiled" and needs_kernel and several:
        auto.agree_compiled(comm, device, hyper_dtype)  # every rank refuses, or none
    choice = auto.choose(config.kernel, device, capture=config.capture, warmup_steps=config.capture_warmup_steps,
                         needs_kernel=needs_kernel, hyper_dtype=hyper_dtype, numel=numel, like=like)
    if config.kernel == "auto" and several:
        choice = auto.agree(choice, comm, device)
    return get_kernels(choice.name), choice
