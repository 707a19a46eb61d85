"""What an iteration needs from the optimizer, split where a whole-iteration graph splits the step.

``opt.step()`` runs the host checks of graphstep/pre_step.py (``CHECKS``, in their order) and then the device
step, after the backward. A captured iteration holds the backward *and* the step in one graph, so the checks
run before the graph (before the forward), except the folded norm's two, which look at what the backward left:
they run inside the graph, between the last backward and the update, where a capture records their device work.
``IterationParts`` is that split, as plain callables over the optimizer's build record.

The engine hands its build record over (``GraphstepOptimizer.iteration_parts``); this module knows which checks
go where.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import pre_step
from ..parallel.agreement import agreement_for
from ..step.stages import baked_values, chain

# Checks that look at what the backward left: inside the graph, after the last backward (in CHECKS' order).
AFTER_BACKWARD = ("fold_notes_writes", "fold_stale")
# Checks an iteration runs otherwise: it runs its backward itself (never "a step before any backward"); it takes
# the names of the params it binds again, to capture over them (``pre_step.bind_buffers``).
NOT_RUN = ("grads_seen", "buffers_bound")


@dataclass(frozen=True)
class IterationParts:
    prepare: Callable[[], list]
    """Host side, before the graph: the optimizer's pre-step checks (replaced, frozen or cast params; edited
    groups), params and buffers replaced by the user taken back into the static buffers, what a user wrote into
    bf16/fp16 params taken into the main params, the hyperparameter refresh. Returns the names taken back: a
    captured iteration over them must be captured again."""
    zero_grads: Callable[[], None]
    """Inside the graph, first: every grad zeroed in place (``opt.zero_grad()``)."""
    before_update: Callable[[], None]
    """Inside the graph, after the last backward: the folded norm's sums the backward did not fold."""
    update: Callable[[], None]
    """Inside the graph: the optimizer's device step (the chain of stages), without profiler ranges."""
    ranged_update: Callable[[], None]
    """The same step with a profiler range per stage while ``opt.ranges`` is on: what eager iterations run."""
    take_back: Callable[[], list]
    """Host side, before an evaluation: params and buffers replaced by the user taken back into the static
    buffers (``prepare``'s part of it, without the step's checks and refresh). Returns the names taken back."""
    after_update: Callable[[], None]
    """Inside the graph, last (host bookkeeping only)."""
    baked: Callable[[], tuple]
    """The host values the step bakes into a capture (``capture.baked.BakedValues`` guards them)."""
    static_inputs: Callable[[], dict]
    """The optimizer's static buffers and scalars by name (what a capture guards before each replay)."""
    agree: Optional[Callable[[bool], bool]]
    """With several ranks: ``agree(stale)`` is True when any rank's iteration went stale (collective: every rank
    calls it at the same iteration), so that all capture again together; None on one process."""


def parts_over(build, live: Callable[[], pre_step.LiveValues], stepped: Callable[[], None], model: torch.nn.Module,
               captures: bool) -> IterationParts:
    """The parts over an optimizer's build record (graphstep/assembly.py ``Build``); ``live()``: what the user may
    change between steps, as pre_step's checks read it; ``stepped()``: tells torch's LR schedulers a step ran."""
    refuse_unsupported(build)
    before = [check for check in pre_step.CHECKS if check.name not in AFTER_BACKWARD]
    after = [check for check in pre_step.CHECKS if check.name in AFTER_BACKWARD]

    def prepare() -> list:
        values, replaced = live(), []
        with pre_step.one_run(build) as read_params:
            for check in before:
                if check.name == "buffers_bound":
                    replaced = pre_step.bind_buffers(build, read_params=read_params)
                elif check.name not in NOT_RUN and (read_params or not check.reads_every_param):
                    check.run(build, values)
        stepped()
        return replaced

    def zero_grads() -> None:
        for buffers in build.domain_buffers:
            buffers.zero_grad()
        build.fold.invalidate()
        if build.shard_bindings is not None:
            build.shard_bindings.rebind_grads()

    def before_update() -> None:
        values = live()
        for check in after:
            check.run(build, values)

    def after_update() -> None:
        build.fold.after_step()

    return IterationParts(prepare=prepare, zero_grads=zero_grads, before_update=before_update,
                          update=chain(build.stages), ranged_update=chain(build.stages, ranges=build.ranges),
                          take_back=lambda: pre_step.bind_buffers(build), after_update=after_update,
                          baked=baked_values(build.stages),
                          static_inputs=lambda: {"hyperparameters": build.hyper.values, **build.tensors.named(),
                                                 **{k: v for d in build.domains for k, v in d.addresses().items()}},
                          agree=_agreement(build, model) if captures else None)


def _agreement(build, model: torch.nn.Module) -> Optional[Callable[[bool], bool]]:
    """The ranks that share the iteration's collectives: the optimizer's groups, or else DDP's."""
    comm, timeout_s = build.comm, build.config.distributed_timeout_s
    agreement = agreement_for(comm.dp_group, comm.mp_group, timeout_s, comm.host_group)
    if agreement is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        agreement = agreement_for(model.process_group, None, timeout_s)
    return None if agreement is None else agreement.any


def refuse_unsupported(build) -> None:
    """What an iteration does not run yet, refused at construction with what to do instead."""
    config = build.config
    if build.host_stages or config.optimizer_cpu_offload:
        raise ValueError("graphstep.Iteration: CPU offload (optimizer_cpu_offload) runs host work after the device "
                         "step, which a graph cannot contain; train with opt.step() instead")
    if config.overlap_grad_reduce or config.overlap_param_gather:
        raise ValueError("graphstep.Iteration: overlap_grad_reduce / overlap_param_gather launch work from backward "
                         "and forward hooks outside any graph; turn them off (the whole iteration is one graph, so "
                         "the reduce runs inside it after the last backward)")
