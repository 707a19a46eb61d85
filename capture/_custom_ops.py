"""Custom ops (``torch.library``, any namespace but torch's own) inside a step, as a dispatch mode sees them.

A mode that intercepts every op (the replay backend's recorder, ``capture.check``) treats a custom op as
one op: what its body does is not its business. The body must then run as the step's own code would run
it, not as the mode's dispatch state would have it: a torch.compile'd kernel inside (graphstep's compiled
kernels and scalar graphs) is guarded by dynamo on its tensors' dispatch keys and on the mode stack, and
under the mode's state would compile again, during the capture or the check.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .unsafe import HostReadMode

__all__ = ["caller_dispatch_state", "is_custom", "called_by_the_user"]

# Operator namespaces of torch itself; any other op is a custom op.
_BUILTIN_NAMESPACES = frozenset({"aten", "prims", "c10d", "_c10d_functional", "c10d_functional", "profiler"})


def caller_dispatch_state() -> tuple:
    """The dispatch-key state of the code about to enter a mode (take it before entering)."""
    return torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()


def is_custom(func: Any) -> bool:
    return getattr(func, "namespace", "aten") not in _BUILTIN_NAMESPACES


@contextlib.contextmanager
def called_by_the_user(dispatch_state: tuple) -> Iterator[None]:
    """Run a custom op with the caller's dispatch-key state (not the one below ADInplaceOrView that a
    dispatch mode sees) and without a HostReadMode on top of the function-mode stack."""
    include, exclude = dispatch_state
    with torch._C._ForceDispatchKeyGuard(include, exclude):
        stack = torch.overrides._get_current_function_mode_stack()
        if stack and isinstance(stack[-1], HostReadMode):
            with torch.overrides._pop_mode_temporarily():
                yield
        else:
            yield
