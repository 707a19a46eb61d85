"""What runs on the host before every step, in one declared order: ``CHECKS``.

Each check reads a part of the engine's build record (graphstep/assembly.py) and what a user may change on
the optimizer between steps (``LiveValues``), and either refuses the step (an error naming what to do, before
anything changed) or keeps the static bindings the captured step relies on. The order matters where one check
acts on what an earlier one left: the fold learns about rewritten grads before it folds stale sums, the
param writes are copied into the main params after the buffers are bound again, and the hyperparameters
are refreshed last, from the groups the checks accepted.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

from .checkpoint.torch_api import STATE_RESET


@dataclass(frozen=True)
class LiveValues:
    """What a user may change on the optimizer between steps, as the checks read it."""
    param_groups: list
    state: Any  # ``opt.state``: the mapping the build made, unless replaced
    attributes: dict  # the optimizer's ``__dict__``: torch's GradScaler sets ``grad_scale`` / ``found_inf`` there
    thresholds: dict  # ``clip_grad`` and ``grad_norm_skip_threshold``, as set on the optimizer


@dataclass(frozen=True)
class PreStepCheck:
    name: str
    reads: tuple[str, ...]  # the build record's parts it reads, and the live values (``live.<field>``)
    does: str  # its refusal, or what it keeps
    run: Callable[[Any, LiveValues], None]  # run(build, live)
    reads_every_param: bool = False  # a check ``OptimizerConfig.param_checks`` may leave out (ParamCheckSchedule)


class ParamCheckSchedule:
    """When the reads of every param run (``OptimizerConfig.param_checks``): before every step ("every_step"), or
    ("on_request") before the first step and the step after each ``request()`` (``opt.check_params()``)."""

    def __init__(self, policy: str):
        self.every_step = policy == "every_step"
        self._requested = True  # the first step reads every param, whatever the policy

    def request(self) -> None:
        self._requested = True

    def due(self) -> bool:
        return self.every_step or self._requested

    def done(self) -> None:
        """The reads ran through: the next step skips them unless the policy or a request says otherwise."""
        self._requested = False


def _fsdp2_bindings(build, live: LiveValues) -> None:
    if build.shard_bindings is not None:
        build.shard_bindings.check()


def _offload_finished(build, live: LiveValues) -> None:
    build.offload.finish()


def _replaced_params(build, live: LiveValues) -> None:
    build.replaced_params.check()


def _requires_grad(build, live: LiveValues) -> None:
    build.requires_grad.check()


def _state_kept(build, live: LiveValues) -> None:
    if live.state is not build.param_state:
        raise TypeError(f"opt.state was replaced. {STATE_RESET}")


def _group_edits(build, live: LiveValues) -> None:
    edited = build.group_watch.unfollowable_edit(live.param_groups)
    if edited is not None:
        raise ValueError(f"graphstep: {edited}")


def _torch_grad_scaler(build, live: LiveValues) -> None:
    if build.torch_amp.copy_scale_and_inf_flag(live.attributes):
        # scaler.unscale_(opt) rewrote the grads unseen by version counters, or the norm's prescale changed
        # since backward folded
        build.fold.grads_rewritten()


def _grads_seen(build, live: LiveValues) -> None:
    build.grads_seen.check()


def _fold_notes_writes(build, live: LiveValues) -> None:
    build.fold.note_writes()  # grads written since backward, before the engine writes any


def bind_buffers(build, read_params: bool = True) -> list:
    """Params, grads and buffers the user replaced copied back into the static buffers and bound again; returns
    the names taken back (the step's runner, or an iteration, must then capture again over them). Without
    ``read_params`` only the buffers and state lists are looked at, not each param and its grad."""
    replaced = []
    for buffers in build.domain_buffers:
        restored = buffers.restore_replaced_buffers()
        if restored:
            build.fold.grads_rewritten()  # copied into the static buffers: the folded sums may be stale
            replaced += restored
        if read_params and not buffers.bindings_intact():
            build.fold.forget_unbound_grads()  # before the grads are re-bound
            replaced += buffers.readopt_params()  # also rebinds grads a user set to None (as zeros)
    if replaced:
        build.model_state_dict.adopt(build.domain_buffers)  # taken back from a later optimizer, say
    return replaced


def _buffers_bound(build, live: LiveValues) -> None:
    replaced = bind_buffers(build, read_params=build.param_checks.due())
    if replaced:
        build.runner.on_replaced(replaced)


def _param_writes(build, live: LiveValues) -> None:
    for writes in build.param_writes:
        writes.copy_writes_into_main()


def _fold_stale(build, live: LiveValues) -> None:
    build.fold.fold_stale()


def _family_group_options(build, live: LiveValues) -> None:
    for g, (group, family) in enumerate(zip(live.param_groups, build.families)):
        problem = family.group_problem(group, build.config) if family.group_problem is not None else None
        if problem is not None:
            raise ValueError(f"graphstep: param group {g}: {problem}")


def _hyperparameters(build, live: LiveValues) -> None:
    build.hyper.refresh(live.param_groups, live.thresholds)


CHECKS = (
    PreStepCheck("fsdp2_bindings", ("shard_bindings",),
                 "an FSDP2 model's grads and params replaced since the last step are copied into the flat buffers "
                 "and bound again; a param moved to another device or dtype is refused", _fsdp2_bindings,
                 reads_every_param=True),
    PreStepCheck("offload_finished", ("offload",),
                 "CPU offload: the last step's overlapped host update is finished", _offload_finished),
    PreStepCheck("replaced_params", ("replaced_params",),
                 "refuses a model param replaced by a new Parameter object", _replaced_params),
    PreStepCheck("requires_grad", ("requires_grad",),
                 "refuses a held param frozen since the build, or a frozen one unfrozen", _requires_grad,
                 reads_every_param=True),
    PreStepCheck("state_kept", ("param_state", "live.state"),
                 "refuses an opt.state replaced (to reset it)", _state_kept),
    PreStepCheck("group_edits", ("group_watch", "live.param_groups"),
                 "refuses param groups or their params lists edited, and torch-only options (maximize, ...)",
                 _group_edits),
    PreStepCheck("torch_grad_scaler", ("torch_amp", "fold", "live.attributes"),
                 "torch's GradScaler's scale and inf flag are copied into the step's tensors; refused with "
                 "graphstep's own loss scale", _torch_grad_scaler),
    PreStepCheck("grads_seen", ("grads_seen",),
                 "warns once when no backward ran since the build", _grads_seen),
    PreStepCheck("fold_notes_writes", ("fold",),
                 "fold_grad_norm: grads written since backward are noted", _fold_notes_writes),
    PreStepCheck("buffers_bound", ("domain_buffers", "fold", "runner", "model_state_dict"),
                 "params, grads and buffers the user replaced are copied back into the static buffers and bound "
                 "again (params and grads: where ParamCheckSchedule says)", _buffers_bound),
    PreStepCheck("param_writes", ("param_writes",),
                 "bf16/fp16: what a user wrote into the params is copied into the main params", _param_writes),
    PreStepCheck("fold_stale", ("fold",),
                 "fold_grad_norm: the sums of grads backward did not fold are folded now", _fold_stale),
    PreStepCheck("family_group_options", ("families", "config", "live.param_groups"),
                 "refuses a group value its family cannot run (Family.group_problem)", _family_group_options),
    PreStepCheck("hyperparameters", ("hyper", "live.param_groups", "live.thresholds"),
                 "the hyperparameter tensors are refreshed from the param groups and thresholds", _hyperparameters),
)
"""The order the checks run in before every step (and ``debug_step``). A new check takes its place here; one that
reads every param says so (``reads_every_param``), and runs when the build's ``ParamCheckSchedule`` says."""


@contextlib.contextmanager
def one_run(build):
    """One run of the checks, yielding whether it reads every param (the build's ``ParamCheckSchedule``): the
    bindings' verdicts its requires_grad watch leaves (``StaticBuffers.bound_and_requiring_grad``) end with it,
    and the schedule hears of a run that went through."""
    try:
        yield build.param_checks.due()
        build.param_checks.done()
    finally:
        for buffers in build.domain_buffers:
            buffers.forget_seen_bound()


def run_checks(build, live: LiveValues) -> None:
    with one_run(build) as read_params:
        for check in CHECKS:
            if read_params or not check.reads_every_param:
                check.run(build, live)
