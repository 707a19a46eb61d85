"""The per-param reads of the pre-step checks: each returns the index of the first tensor of a list whose
attributes differ from the ones expected, or -1.

The compiled loop of param_checks.cpp where it is built (graphstep/native/build.py): one visit per tensor,
expected values in flat ``array('q')``s. Else the same reads as C-level ``map``s in Python, with tensor
subclasses' ``__torch_function__`` off (the attribute itself, as the compiled loop reads it). Either way a step
reads every param: torch has no hook on an assignment to ``.grad`` or ``.data``, so only a read of each can tell.
"""

from __future__ import annotations

import array
import itertools
import operator
from typing import Optional, Sequence

import torch

from . import build

_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_VERSION = operator.attrgetter("_version")


def int64s(values) -> array.array:
    """Expected data pointers or versions, as the checks take them."""
    return array.array("q", values)


def first_unbound(tensors: list, *, data_ptrs: Optional[array.array] = None, grads: Optional[list] = None,
                  requires_grad: Optional[bool] = None, attribute: Optional[str] = None) -> int:
    """The first ``i`` with ``tensors[i].data_ptr() != data_ptrs[i]``, or ``tensors[i].grad`` not the very object
    ``grads[i]`` (where that is not None), or ``tensors[i].requires_grad != requires_grad``; -1 if none. An
    expectation left None is not checked. With ``attribute``, ``tensors`` holds objects and the tensors read
    are ``getattr(tensors[i], attribute)`` (FSDP2's sharded data, a DTensor's local tensor)."""
    module = build.loaded()
    if module is not None:
        return module.first_unbound(tensors, data_ptrs, grads, requires_grad, attribute)
    if attribute is not None:
        if not isinstance(attribute, str):
            raise TypeError("attribute must be a str or None")
        with torch._C.DisableTorchFunctionSubclass():
            tensors = list(map(operator.attrgetter(attribute), tensors))
        if not all(map(torch.is_tensor, tensors)):
            bad = next(i for i, t in enumerate(tensors) if not torch.is_tensor(t))
            raise TypeError(f"the attribute of tensors[{bad}] is not a tensor")
    found = [_first_other_data_ptr(tensors, data_ptrs) if data_ptrs is not None else -1,
             _first_other_grad(tensors, grads) if grads is not None else -1,
             _first_requires_grad_not(tensors, requires_grad) if requires_grad is not None else -1]
    return min((i for i in found if i >= 0), default=-1)


def versions(tensors: list) -> array.array:
    """The tensors' version counters now, as ``first_other_version`` takes them."""
    with torch._C.DisableTorchFunctionSubclass():
        return int64s(map(_VERSION, tensors))


def first_other_version(tensors: list, expected: array.array) -> int:
    """The first ``i`` with ``tensors[i]._version != expected[i]``, or -1."""
    module = build.loaded()
    if module is not None:
        return module.first_other_version(tensors, expected)
    return _first_difference(versions(tensors), expected)


def _first_other_data_ptr(tensors: list, data_ptrs: array.array) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return _first_difference(int64s(map(torch.Tensor.data_ptr, tensors)), data_ptrs)


def _first_other_grad(tensors: list, grads: list) -> int:
    _same_length(tensors, grads, "grads must be a list")
    with torch._C.DisableTorchFunctionSubclass():
        if all(map(operator.is_, map(_GRAD, tensors), grads)):  # the fast pass: an unchecked grad is None too
            return -1
        return next((i for i, (t, grad) in enumerate(zip(tensors, grads)) if grad is not None and t.grad is not grad),
                    -1)


def _first_requires_grad_not(tensors: list, flag: bool) -> int:
    flag = bool(flag)
    with torch._C.DisableTorchFunctionSubclass():
        if all(map(operator.is_, map(_REQUIRES_GRAD, tensors), itertools.repeat(flag))):
            return -1
        return next(i for i, t in enumerate(tensors) if t.requires_grad is not flag)


def _first_difference(now: array.array, expected: Sequence[int]) -> int:
    _same_length(now, expected, "expected values must be an array('q')")
    if now == expected:
        return -1
    return next(i for i, (a, b) in enumerate(zip(now, expected)) if a != b)


def _same_length(tensors, expected, what: str) -> None:
    if len(tensors) != len(expected):
        raise ValueError(f"{what} as long as tensors")
