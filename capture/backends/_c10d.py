"""What the replay backend needs to know about torch.distributed's c10d ops.

``dist.all_reduce(t)`` and friends dispatch as ops such as ``c10d.allreduce_.default(...)`` that return
``(tensors, Work)``. The replay backend bakes the ProcessGroup / ReduceOp objects by reference and waits on every
Work at once. Why at once: gloo finishes some collectives inside ``Work.wait()`` by dispatching ordinary aten ops
(``split`` + ``copy_`` from an internal buffer), which a recorder would bake in as copies of the capture step's
stale result. So the recorder ignores every op dispatched while a ``Work.wait()`` runs: ``hide_ops_inside_wait()``
wraps ``Work.wait`` for the duration of a recording only (there is no per-object hook); its flag is per thread.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from ._patch import SharedPatch

_WORK_TYPE = "__torch__.torch.classes.c10d.Work"
_state = threading.local()


def _work_class():
    if not torch.distributed.is_available():
        return None
    return torch._C._distributed_c10d.Work


def is_work(x: Any) -> bool:
    """True for the Work ScriptObject a c10d op returns."""
    if not isinstance(x, torch.ScriptObject):
        return False
    try:
        return x._type().qualified_name() == _WORK_TYPE
    except RuntimeError:
        return False


def wait(work: Any) -> None:
    """Block until a c10d op's Work (a ScriptObject) is complete."""
    _work_class().unbox(work).wait()


def inside_wait() -> bool:
    """True while this thread is inside Work.wait() (during a recording)."""
    return getattr(_state, "depth", 0) > 0


def _marking_wait(original):
    def wait_marked(self, *args, **kwargs):
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _state.depth -= 1
    return wait_marked


_wait_patch = SharedPatch("wait", _marking_wait)


@contextlib.contextmanager
def hide_ops_inside_wait() -> Iterator[None]:
    """Make `inside_wait()` report Work.wait() calls for the duration of the block."""
    cls = _work_class()
    if cls is None:
        yield
        return
    with _wait_patch.active(cls):
        yield
