"""The update math over lists of flat views, with interchangeable implementations (fused, compiled, reference).

An implementation module offers ``ENTRY_POINTS`` (entry name -> function; the signatures are documented where a
family declares that it calls them, graphstep/families/) and ``LIVE_FIELDS`` (the hyperparameters it reads from
0-d device tensors; the others are Python floats a capture bakes in, guarded by the engine). A family declares
the entry points it calls (``Family.entry_points``); ``choose_kernels`` refuses an implementation lacking one.
Every entry updates in place. ``grad_scale`` (0-d fp32, or None for 1) divides the grads, folding loss-scale
unscaling and the clip coefficient into the update; the fused and reference kernels leave the grads divided on
an applied step (as torch's fused kernels do), the compiled one leaves them as they were (the grads are spent
after the step). ``found_inf`` (0-d fp32, 1.0 = skip) leaves params and state bitwise unchanged.
``OptimizerConfig.kernel="auto"`` (the default) is a choice between two implementations, made once at build
(kernels/auto.py).
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
                   numel=None, like=None, native=False) -> tuple[ModuleType, "auto.KernelChoice"]:
    """The implementation module ``config.kernel`` means on ``device`` ("auto" resolved), and why. ``comm``
    (graphstep.parallel.collectives.Collectives): with several data-parallel ranks, "auto" is agreed across them
    (``auto.agree``: a build-time collective), and so is the refusal of a "compiled" that fails anywhere.
    ``hyper_dtype``: the step's hyperparameter dtype, which "auto" probes the compiled kernel with (float64 if
    None). ``families``: the step's, each of whose ``entry_points`` the implementation must offer. ``numel``:
    elements this rank's update covers. ``like``: the step's ``auto.StepShape``, for a probe that compiles the
    step's own variant. ``native``: every compiled call of the step runs the native loop (``auto.choose``)."""
    needs_kernel = any(map(auto.runs_configured_kernel, families))
    hyper_dtype = hyper_dtype or torch.float64
    several = comm is not None and comm.dp_size > 1
    if config.kernel == "compiled" and needs_kernel and several:
        auto.agree_compiled(comm, device, hyper_dtype, native)  # every rank refuses, or none
    choice = auto.choose(config.kernel, device, capture=config.capture, warmup_steps=config.capture_warmup_steps,
                         needs_kernel=needs_kernel, hyper_dtype=hyper_dtype, numel=numel, like=like,
                         native=native)
    if config.kernel == "auto" and several:
        choice = auto.agree(choice, comm, device)
    module = get_kernels(choice.name)
    _check_offers(choice.name, module, families)
    return module, choice


def _check_offers(name: str, module, families) -> None:
    """Refuse ``module`` (``kernel=name``) when it lacks an entry point a family of the step calls."""
    for family in families:
        missing = [entry for entry in family.entry_points if entry not in module.ENTRY_POINTS]
        if missing:  # only a family on the configured kernels declares entry points (Family.__post_init__)
            offering = [other for other, candidate in IMPLEMENTATIONS.items()
                        if all(entry in candidate.ENTRY_POINTS for entry in family.entry_points)]
            raise ValueError(f"kernel={name!r} offers no {missing[0]!r} entry point, which {family.title}'s update "
                             f"calls: use kernel= one of {', '.join(map(repr, offering))}")
