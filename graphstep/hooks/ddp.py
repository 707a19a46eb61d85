"""The engine beside torch's ``DistributedDataParallel``: whether DDP reduces the model's grads, and what is
supported, refused and warned about then (docs/parallelism.md, "Which data-parallel setup").

DDP with ``use_distributed_optimizer=False`` is supported, in every precision: DDP averages the grads across
ranks and every rank runs the whole step on the average. DDP writes the averaged grads back into ``.grad`` at
the end of backward, after graphstep's grad hooks ran, so a grad folded in backward would be folded again
before the step: once DDP is seen, the fold runs only right before the step, over the averaged grads. fp32
params need nothing more: their ``.grad`` is a view of the flat grad buffer, which DDP's copy-back writes in
place (with ``gradient_as_bucket_view=True`` the step takes it back from DDP's bucket before reading it);
bf16/fp16 params' main grads wait for DDP's average (``DdpWatch``).

Refused: DDP with ``use_distributed_optimizer=True`` (graphstep's distributed optimizer reduce-scatters the
grads itself, and DDP's all-reduce would average them a second time), fp8 params under DDP, and a model cast
after DDP wrapped it. Warned once: several ranks with neither DDP nor the distributed optimizer, each training
apart on its own grads (a job may do that on purpose: independent runs per rank).
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from ..config.listing import listed
from ..config.warn import warn_user
from ..fp8 import is_fp8
from . import weak_hooks

_ACTIVE = "_active_ddp_module"
_DOUBLE_AVERAGE = ("graphstep: the model runs under DistributedDataParallel and the optimizer has "
                   "use_distributed_optimizer=True: the distributed optimizer reduce-scatters the grads itself, so "
                   "DDP's all-reduce would average them twice. Give graphstep the bare model (without DDP): its "
                   "distributed optimizer does the data-parallel reduction; or keep DDP and set "
                   "use_distributed_optimizer=False")
_FP8_UNREDUCED = ("graphstep: the model runs under DistributedDataParallel and has fp8 params ({names}): their "
                  "backward adds the grad into main_grad and leaves .grad None, so DDP never averages it and each "
                  "rank would step on its own grad. Give graphstep the bare model with "
                  "use_distributed_optimizer=True: it reduces main_grad itself")
_NOT_REDUCED = ("graphstep: bf16/fp16 params under DistributedDataParallel: backward ended before DDP had written "
                "the averaged grads back, so the step would read this rank's own grads. A reentrant backward does "
                "that (torch.utils.checkpoint with use_reentrant=True): use use_reentrant=False, or give graphstep "
                "the bare model with use_distributed_optimizer=True")
_CAST_AFTER_WRAPPING = ("graphstep: DistributedDataParallel was built over params of {built}, which are now {now} "
                        "({names}): torch drops a param's grad accumulator when its dtype changes and DDP's hooks "
                        "stay on the old one, so DDP would no longer average these grads. Cast the model before "
                        "wrapping it in DDP (model.to(torch.bfloat16)), or give get_optimizer the bare model (its "
                        "bf16/fp16 cast it) and wrap it in DDP after")
_MAIN_GRAD = "main_grad"  # the grad-hook stage that moves a half grad into its fp32 main grad
# DDP's construction-time record of its params' dtypes (``_get_ddp_logging_data()["dtypes"]``) names them so.
_DDP_DTYPE_NAMES = {"float": torch.float32, "double": torch.float64, "c10::Half": torch.float16,
                    "c10::BFloat16": torch.bfloat16}


def _wrapped(chunks: Sequence[torch.nn.Module]) -> list:
    """The DDP modules inside the chunks."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, DistributedDataParallel)]


def _fp8_names(modules: Sequence[torch.nn.Module]) -> list:
    return [name for module in modules for name, p in module.named_parameters() if is_fp8(p)]


def _refuse_fp8(modules: Sequence[torch.nn.Module], error: type) -> None:
    """Refuse fp8 params under DDP: their backward adds into ``main_grad`` directly and leaves ``.grad`` None, so
    DDP never sees their grads."""
    names = _fp8_names(modules)
    if names:
        raise error(_FP8_UNREDUCED.format(names=listed(names, 3)))


def _refuse_cast_after_wrapping(ddps: Sequence[torch.nn.Module], error: type) -> None:
    """Refuse params whose dtype is not one DDP built its buckets for (read defensively: where torch does not
    record them, or names one unknown here, nothing is decided): a model cast after DDP wrapped it
    (``OptimizerConfig(bf16=True)`` over a float32 model handed over inside DDP, or ``model.to(torch.bfloat16)``
    after ``DDP(model)``). torch drops a param's grad accumulator when its dtype changes, and DDP's hooks stay on
    the old one, so DDP would silently average nothing."""
    for ddp in ddps:
        logging_data = getattr(ddp, "_get_ddp_logging_data", None)
        recorded = logging_data().get("dtypes") if logging_data is not None else None
        if not isinstance(recorded, str):
            continue
        names = [name.strip() for name in recorded.split(",")]
        if not all(name in _DDP_DTYPE_NAMES for name in names):
            continue
        built = {_DDP_DTYPE_NAMES[name] for name in names}
        cast = [(name, p.dtype) for name, p in ddp.module.named_parameters() if p.requires_grad and p.dtype not in built]
        if cast:
            raise error(_CAST_AFTER_WRAPPING.format(built=" and ".join(sorted(map(str, built))),
                                                    now=" and ".join(sorted({str(d) for _, d in cast})),
                                                    names=listed((name for name, _ in cast), 3)))


def check_at_build(chunks: Sequence[torch.nn.Module], distributed_optimizer: bool) -> None:
    """Refuse a model handed over inside DDP with the distributed optimizer, or with fp8 params, before anything
    is built."""
    ddps = _wrapped(chunks)
    if ddps and distributed_optimizer:
        raise ValueError(_DOUBLE_AVERAGE)
    _refuse_fp8(ddps, ValueError)


def _wraps(ddp, chunk: torch.nn.Module) -> bool:
    return ddp is not None and any(m is chunk for m in ddp.modules())


def _reduction_finished(ddp) -> bool:
    """Whether DDP has no reduction pending (its reducer's own check, read defensively: True where a torch
    version lacks it)."""
    check = getattr(getattr(ddp, "reducer", None), "_check_reducer_finalized", None)
    if check is None:
        return True
    try:
        check()
    except RuntimeError:
        return False
    return True


class DdpWatch:
    """Decides whether DDP reduces this model's grads (``under_ddp``), refusing or warning as the module doc says.
    ``on_ddp``: called once when DDP is seen (the engine moves the fold to the step). ``hooks``: the optimizer's
    ``GradHooks``, whose main-grad stage waits for DDP's averaged grads under DDP.

    Seeing DDP. A model handed over already wrapped (``get_optimizer(config, DDP(model))``) is known at build. A
    bare model that DDP wraps later is seen at its first forward: DDP runs the wrapped module's forward with
    ``DistributedDataParallel._active_ddp_module`` set (a torch attribute, read defensively: where a torch version
    lacks it, nothing is decided and nothing is warned), which a forward pre-hook on each model chunk reads once
    and removes itself.

    bf16/fp16 params. Their main-grad stage would add the local grad into the fp32 main grad and drop ``.grad``
    before DDP's reducer reads it (torch runs a param's post-accumulate-grad hooks before DDP's hooks on the same
    param), so DDP would average nothing and every rank would step on its own grad. Under DDP the stage is
    postponed: the half grad stays in ``.grad`` through backward, where DDP averages it and writes the average
    back, and DDP's ``no_sync()`` micro-batches accumulate in it as DDP expects; after DDP's end-of-backward
    copy-back the average is added into the main grad and ``.grad`` dropped (``_take_reduced_grads``)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], *, distributed_optimizer: bool, explicit_groups: bool,
                 on_ddp: Callable[[], None], hooks):
        self.under_ddp = False
        self._distributed_optimizer = distributed_optimizer
        self._on_ddp = on_ddp
        self._hooks = hooks
        self._chunks = list(chunks)
        self._handles = weak_hooks.Handles(self)
        # Kept through remove() (the engine's close()): later steps still train, and under DDP still wait for
        # DDP's averaged grads.
        self._ddp_handles = weak_hooks.Handles(self)
        self._ddps: list = []  # the DDP modules seen, weakly: the model outlives the optimizer, not the reverse
        self._end_queued = False  # this backward's first end-of-backward callback is queued
        ddps = _wrapped(chunks)
        if ddps:  # with the distributed optimizer and fp8 params refused already (check_at_build)
            self._seen(True, ddps, refusal=ValueError)
            return
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # With explicit process groups the caller laid out its own parallelism (say tensor-parallel ranks that
        # share data): no warning about ranks training apart.
        self._warn_alone = several and not distributed_optimizer and not explicit_groups
        if several and hasattr(DistributedDataParallel, _ACTIVE):
            for chunk in self._chunks:
                self._handles.append(chunk.register_forward_pre_hook(weak_hooks.calling(self, "_first_forward",
                                                                                       chunk)))

    def _first_forward(self, chunk: torch.nn.Module, module, args) -> None:
        self._handles.remove()
        active = getattr(DistributedDataParallel, _ACTIVE, None)
        under_ddp = _wraps(active, chunk)
        self._seen(under_ddp, [active] if under_ddp else [])

    def _seen(self, under_ddp: bool, ddps: list, refusal: type = RuntimeError) -> None:
        if under_ddp and self._distributed_optimizer:
            raise RuntimeError(_DOUBLE_AVERAGE)
        if under_ddp:
            _refuse_fp8(ddps, refusal)
            _refuse_cast_after_wrapping(ddps, refusal)
            self.under_ddp = True
            self._on_ddp()
            if not self._hooks.listening(_MAIN_GRAD):
                return  # no param's grad goes through an fp32 main grad: DDP writes the step's grads in place
            self._ddps = [weakref.ref(ddp) for ddp in ddps]
            for ddp in ddps:
                self._ddp_handles.append(ddp.register_forward_hook(weak_hooks.calling(self, "_ddp_forward")))
            self._hooks.postpone(_MAIN_GRAD, weak_hooks.calling(self, "_half_grad_kept"))
        elif self._warn_alone:
            warn_user(
                f"graphstep: this process is one of {dist.get_world_size()} ranks, but its model runs without "
                "DistributedDataParallel and the optimizer without use_distributed_optimizer=True: each rank "
                "steps on its own grads and the ranks train apart. Wrap the model in DDP (with "
                "use_distributed_optimizer=False), or set use_distributed_optimizer=True and give graphstep the "
                "bare model", RuntimeWarning)

    def _ddp_forward(self, module, args, output) -> None:
        """After each DDP forward: its output's grad queues the end-of-backward callbacks in the outermost
        backward. (A backward that raised never ran its callbacks: each forward starts afresh.)"""
        self._end_queued = False
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                leaf.register_hook(weak_hooks.calling(self, "_output_grad"))

    def _output_grad(self, grad) -> None:
        self._queue_end()

    def _half_grad_kept(self) -> None:
        """A half param's grad arrived and stays in ``.grad`` for DDP (the postponed main-grad stage)."""
        self._queue_end()

    def _queue_end(self) -> None:
        """Queue this backward's end callback once: when the DDP module's output gets its grad (a hook that
        ``_ddp_forward`` puts on the output: it runs in the outermost backward, also where
        ``checkpoint(use_reentrant=True)`` runs the params' grads in nested ones), or else at the first half grad."""
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ending)

    def _backward_ending(self) -> None:
        """DDP queues its copy-back on the backward (``queue_callback``) when its last bucket is ready (or, on a
        ``static_graph`` model's first iteration, from its output's backward), which may come after this callback.
        So this one queues a second, which runs after DDP's (torch runs callbacks queued while callbacks run, in
        order)."""
        torch.autograd.Variable._execution_engine.queue_callback(self._take_reduced_grads)

    def _take_reduced_grads(self) -> None:
        """After DDP's copy-back: the averaged half grads into the fp32 main grads. Not after a backward under
        DDP's ``no_sync()``: DDP accumulates the micro-batches in ``.grad`` and reduces them in the last one.
        Whether DDP reduced this backward is what its last forward decided (``require_forward_param_sync``, False
        under ``no_sync()``); where DDP expected to reduce and had not finished, this raises rather than let the
        step read unreduced grads. None of this syncs with the device."""
        self._end_queued = False
        ddps = [ddp for ddp in (ref() for ref in self._ddps) if ddp is not None]
        reducing = [ddp for ddp in ddps if getattr(ddp, "require_forward_param_sync", True)]
        if ddps and not reducing:
            return
        if not all(_reduction_finished(ddp) for ddp in reducing):
            raise RuntimeError(_NOT_REDUCED)
        self._hooks.run_postponed(_MAIN_GRAD)

    def remove(self) -> None:
        """Drop the first-forward hooks; under DDP the main grads keep waiting for DDP's averaged grads."""
        self._handles.remove()
