"""capture.check(fn): list everything that makes `fn` unsafe to capture.

It runs `fn` ONCE, for real (a step is taken), under a TorchDispatchMode that sees every aten op and a
TorchFunctionMode that sees host reads that dispatch nothing (`.tolist()`, `.numpy()`). Nothing is refused, so
one run finds every problem, not just the first. Findings:

  host_sync        the host waits for a device value (`.item()`, `if t:`, nonzero, ...)
  device_to_host   a copy to the CPU, unless non_blocking into pinned memory
  host_to_device   a copy from the CPU, unless non_blocking from pinned memory
  host_tensor      a tensor made from Python data inside the step: a value frozen at capture
  rng              an op that draws from the RNG: a graph replays the draw pattern
  escaping_tensor  a tensor made inside the step and kept after it (on an object, a .grad) without being
                   returned: memory the next replay overwrites, or a value frozen at capture
"""
from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves

from ._custom_ops import called_by_the_user, caller_dispatch_state, is_custom
from ._location import user_location
from .errors import ESCAPING_TENSOR, HOST_SYNC, Finding
from .unsafe import HostReadMode, classify, op_name

__all__ = ["check"]


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage
        return 0


def _finding(kind: str, func: Any) -> Finding:
    filename, lineno, line = user_location()
    return Finding(kind, op_name(func), filename, lineno, line)


class _CheckMode(TorchDispatchMode):
    """Notes unsafe ops and keeps weak references to every tensor an op allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.host_reads = HostReadMode(lambda func: self.note(HOST_SYNC, func))
        self.findings: list[Finding] = []
        # (weakref to an op output, the Finding to report if it escapes)
        self.fresh: list[tuple[weakref.ref, Finding]] = []
        # Storages allocated by ops inside fn. Views of memory that existed before
        # the step (params, buffers) are not escaping allocations.
        self.fresh_storages: set[int] = set()
        self.dispatch_state = caller_dispatch_state()  # taken before the mode is entered (_custom_ops.py)

    def note(self, kind: str, func: Any) -> None:
        self.findings.append(_finding(kind, func))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = classify(func, args, kwargs)
        if kind is not None and not self.host_reads.inside:  # already reported as Tensor.*
            self.note(kind, func)
        if is_custom(func):  # its body runs as the step's code would run it: a warmed compile serves it
            with called_by_the_user(self.dispatch_state):
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        input_ids = {id(x) for x in inputs}
        input_storages = {_storage_key(x) for x in inputs}
        for y in tree_flatten(out)[0]:
            if isinstance(y, torch.Tensor) and id(y) not in input_ids:
                key = _storage_key(y)
                if key and key not in input_storages:
                    self.fresh_storages.add(key)
                self.fresh.append((weakref.ref(y), _finding(ESCAPING_TENSOR, func)))
        return out


def check(fn: Callable[[], Any]) -> list[Finding]:
    """Run `fn()` once and return every Finding that makes it unsafe to capture.

    `fn` really runs (an optimizer step is taken). The return value of `fn` is allowed
    to hold tensors allocated inside it: those become the graph-owned outputs.
    """
    mode = _CheckMode()
    with mode.host_reads, mode:
        result = fn()
    returned = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
    returned_ids = {id(t) for t in returned}
    returned_storages = {_storage_key(t) for t in returned}
    del result, returned
    gc.collect()
    findings = list(mode.findings)
    reported: set[int] = set()  # one finding per escaping allocation, not per view
    for ref, finding in mode.fresh:
        t = ref()
        if t is None or id(t) in returned_ids:
            continue
        key = _storage_key(t)
        if key in mode.fresh_storages and key not in returned_storages and key not in reported:
            reported.add(key)
            findings.append(finding)
        del t
    return findings
