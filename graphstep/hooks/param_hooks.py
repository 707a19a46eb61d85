"""One post-accumulate-grad hook per param per optimizer, calling its listeners in one declared order.

Several parts of an optimizer act on a param's grad right after backward accumulated it: the fp32 main
grad (graphstep/state/buffers.py), the "a backward ran" flag (grads_seen.py), the folded norm (fold.py) and
the overlapped reduce-scatter (grad_overlap.py). Each listens here at its stage of ``STAGES``, and the
param's one hook runs them in that order, whatever order they were added in: the order is this tuple, not
the order of statements in the engine's build.

Lifetime (as graphstep/hooks/weak_hooks.py): the model outlives optimizers. The hook on a param reaches the
dispatcher only through a weak reference, and the dispatcher reaches each listener's owner and the
param's buffers only through weak references too. So the model never keeps a dropped optimizer's buffers
alive; a hook that fires after an owner died skips that owner; and the dispatcher's collection (it lives
as long as its optimizer) removes its hooks. An owner's ``remove`` (the engine's ``close()``) drops its
listeners, and a param left without any loses its hook, so later backwards pay nothing for it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

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
    """One optimizer's post-accumulate-grad hooks: at most one per param, registered at its first listener."""

    def __init__(self):
        # Keyed by id(param): the optimizer holds its params (param_groups, buffers) as long as it holds this,
        # so an id is never reused under it.
        self._entries: dict[int, _ParamEntry] = {}
        self._handles: dict[int, Any] = {}
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
            listener(param)

