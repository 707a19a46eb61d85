"""Hooks on the model (its params' post-accumulate-grad hooks, its modules' forward pre-hooks) that reach
the part of the optimizer they serve only through a weak reference.

The model outlives optimizers: a hook that held its owner would keep a dropped optimizer's buffers (its
grads, optimizer state and main params: gigabytes at scale) alive, and keep acting on them, for as long as
the model lives. Here the owner's collection removes its hooks, and a hook that fires before that finds no
owner and does nothing. A param's post-accumulate-grad hook is one per optimizer, a dispatcher of ordered
listeners built on these (graphstep/hooks/param_hooks.py).
"""

from __future__ import annotations

import weakref
from typing import Any


class WeakCall:
    """Calls ``owner.<method>(*args, *call_args)`` while ``owner`` lives, and does nothing after. ``owner``
    is the weak reference (graphstep/hooks/param_hooks.py drops listeners by it)."""

    __slots__ = ("owner", "method", "args")

    def __init__(self, owner: Any, method: str, args: tuple):
        self.owner = weakref.ref(owner)
        self.method = method
        self.args = args

    def __call__(self, *call_args) -> None:
        live = self.owner()
        if live is not None:
            getattr(live, self.method)(*self.args, *call_args)


def calling(owner: Any, method: str, *args) -> WeakCall:
    """A hook that calls ``owner.<method>(*args, *hook_args)`` while ``owner`` lives, and does nothing after."""
    return WeakCall(owner, method, args)


class Handles:
    """The handles of an owner's hooks: removed all at once by ``remove`` or when the owner is collected."""

    def __init__(self, owner: Any):
        self._handles: list = []
        weakref.finalize(owner, self.remove)  # the finalizer holds this object, never the owner

    def append(self, handle) -> None:
        self._handles.append(handle)

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
