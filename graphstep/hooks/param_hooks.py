"""One post-accumulate-grad hook per param per optimizer, calling its listeners in one declared order.

Several parts of an optimizer act on a param's grad right after backward accumulated it: the fp32 main
grad (graphstep/state/buffers.py), the "a backward ran" flag (grads_seen.py), the folded norm (fold.py) and
the overlapped reduce-scatter (grad_overlap.py). Each listens here at its stage of ``STAGES``, and the
param's one hook runs them in that order, whatever order they were added in: the order is this tuple, not
the order of statements in the engine's build.

The model outlives optimizers (as graphstep/hooks/weak_hooks.py): the hooks reach an optimizer only through
weak references, and go with it (``GradHooks``). Under DDP the main-grad stage runs after backward instead
(``GradHooks.postpone``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import weak_hooks


@dataclass(frozen=True)
class Stage:
    name: str
    owned: bool
    """Runs only while the param is still laid out in this optimizer's buffers (``StaticBuffers.owns``): an
    optimizer built later over the same model takes the params over, and this one must leave them alone."""


STAGES = (
    # A half grad is added into the fp32 main grad and dropped: the later stages read the grad where the
    # step reads it (grad_flat).
    Stage("main_grad", owned=True),
    # The first grad of any param records that a backward ran (its listeners then go). Not checked for
    # ownership: an optimizer whose params a later one took still learns that a backward ran, as it always did.
    Stage("grads_seen", owned=False),
    # One rank: the param's row norms are folded while its grad is hot (only the dense domain on one rank).
    Stage("fold", owned=True),
    # Several ranks: the bucket's reduce-scatter is launched once its last grad arrived.
    Stage("overlap", owned=True),
)
"""The order a param's listeners run in. A new listener (e.g. offload acting on grads) takes its place here.
Before this dispatcher the separate hooks ran main_grad, overlap, grads_seen, fold (the engine's statement
order); the two orders call the same code: the fold listens only on one rank and the overlap only with
several, so never both on one param, and grads_seen only sets a flag none of the others reads."""

_STAGE_NAMES = tuple(stage.name for stage in STAGES)


class _ParamEntry:
    """One param's listeners, by stage name, and the buffers (weakly) whose ownership the owned stages need."""

    __slots__ = ("buffers", "index", "listeners")

    def __init__(self, buffers, index: int):
        self.buffers = weakref.ref(buffers)
        self.index = index
        self.listeners: dict[str, weak_hooks.WeakCall] = {}

    def owned_by_buffers(self, param: torch.nn.Parameter) -> bool:
        buffers = self.buffers()
        return buffers is not None and buffers.owns(self.index, param)


def _remove_all(handles: dict) -> None:
    for handle in list(handles.values()):
        handle.remove()
    handles.clear()


class GradHooks:
    """One optimizer's post-accumulate-grad hooks: at most one per param, registered at its first listener.

    The hook on a param reaches this dispatcher only through a weak reference, and the dispatcher reaches each
    listener's owner and the param's buffers only through weak references too. So the model never keeps a
    dropped optimizer's buffers alive; a hook that fires after an owner died skips that owner; and collecting
    the dispatcher (it lives as long as its optimizer) removes its hooks. An owner's ``remove`` (the engine's
    ``close()``) drops its listeners, and a param left without any loses its hook, so later backwards pay
    nothing for it."""

    def __init__(self):
        # Keyed by id(param): the optimizer holds its params (param_groups, buffers) as long as it holds this,
        # so an id is never reused under it.
        self._entries: dict[int, _ParamEntry] = {}
        self._handles: dict[int, Any] = {}
        self._postponed: dict[str, Callable[[], None]] = {}  # stage -> what a hook calls instead of its listener
        weakref.finalize(self, _remove_all, self._handles)  # holds the handles, never this object

    def listen(self, stage: str, buffers, index: int, owner: Any, method: str, *args) -> None:
        """At ``stage``, each time backward accumulated the grad of param ``index`` of ``buffers``:
        ``owner.<method>(*args, param)`` while ``owner`` lives."""
        if stage not in _STAGE_NAMES:
            raise ValueError(f"graphstep: unknown grad-hook stage {stage!r}: add it to param_hooks.STAGES, "
                             f"which orders {_STAGE_NAMES}")
        param = buffers.params[index]
        key = id(param)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _ParamEntry(buffers, index)
            self._handles[key] = param.register_post_accumulate_grad_hook(weak_hooks.calling(self, "_fire", key))
        elif entry.buffers() is not buffers or entry.index != index:
            raise ValueError(f"graphstep: param {index} is listened to through two different buffers: "
                             "each param belongs to one domain of one optimizer")
        if stage in entry.listeners:
            raise ValueError(f"graphstep: param {index} already has a {stage!r} listener")
        entry.listeners[stage] = weak_hooks.calling(owner, method, *args)

    def remove(self, owner: Any) -> None:
        """Drop ``owner``'s listeners; a param left without any loses its hook. Safe from inside a listener."""
        for key, entry in list(self._entries.items()):
            for stage, listener in list(entry.listeners.items()):
                if listener.owner() is owner:
                    del entry.listeners[stage]
            if not entry.listeners:
                del self._entries[key]
                self._handles.pop(key).remove()

    def postpone(self, stage: str, arrived: Callable[[], None]) -> None:
        """From now on a param's hook skips ``stage``'s listener and calls ``arrived()`` instead; the listeners run
        from ``run_postponed``. Only for a stage whose later stages do not read what it writes.

        torch's DistributedDataParallel averages ``.grad`` after these hooks ran (its reducer's hooks follow a
        param's post-accumulate-grad hooks), so under DDP the main-grad stage must not take the half grad out of
        ``.grad`` in backward: graphstep/hooks/ddp.py postpones it and runs it once DDP wrote the averaged grads
        back. The stages after it then run before it; under DDP they read nothing it writes (the fold only marks
        its sums stale, for the step to fold; the overlap is refused with DDP)."""
        if stage not in _STAGE_NAMES:
            raise ValueError(f"graphstep: unknown grad-hook stage {stage!r}: one of {_STAGE_NAMES}")
        self._postponed[stage] = arrived

    def listening(self, stage: str) -> bool:
        """Whether any param has a ``stage`` listener."""
        return any(stage in entry.listeners for entry in self._entries.values())

    def run_postponed(self, stage: str) -> None:
        """Run ``stage``'s listener for every param that has a ``.grad`` now and is still owned (as its hook would
        have, stage by stage). Outside any hook: from a callback at the end of backward."""
        owned_stage = STAGES[_STAGE_NAMES.index(stage)].owned
        for entry in list(self._entries.values()):
            listener = entry.listeners.get(stage)
            buffers = entry.buffers()
            if listener is None or buffers is None:
                continue
            param = buffers.params[entry.index]
            if param.grad is None or (owned_stage and not entry.owned_by_buffers(param)):
                continue
            listener(param)

    def stages_of(self, param: torch.nn.Parameter) -> tuple[str, ...]:
        """The stages listening to ``param``, in the order its hook runs them (for tests and debugging)."""
        entry = self._entries.get(id(param))
        return () if entry is None else tuple(name for name in _STAGE_NAMES if name in entry.listeners)

    def _fire(self, key: int, param: torch.nn.Parameter) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        owned = None  # checked once, at the first owned stage: no listener changes which optimizer owns a param
        for stage in STAGES:
            listener = entry.listeners.get(stage.name)  # looked up each time: a listener may remove others
            if listener is None:
                continue
            if stage.owned:
                if owned is None:
                    owned = entry.owned_by_buffers(param)
                if not owned:
                    continue
            postponed = self._postponed.get(stage.name)
            if postponed is not None:  # its listener runs later, from run_postponed
                postponed()
                continue
            listener(param)

