"""The one list of operations that make a step unsafe to capture: ``check()`` reports them and the replay
backend refuses them while recording, so both read this module.

Two levels are needed. aten ops, seen by a TorchDispatchMode: host syncs all end up as
``aten._local_scalar_dense``; ``nonzero`` and boolean masks have data-dependent shapes; host data entering the
step (``aten.lift_fresh`` of a tensor made from Python data, a CPU-to-device copy that is not ``non_blocking``
from pinned memory) is a sync a CUDA capture refuses, or a value baked silently on the CPU, so it is refused on
every device. Python scalars are not host tensors: they become kernel arguments, baked on every backend. And
tensor methods that read memory without dispatching anything (``.tolist()``, ``.numpy()`` on a CPU tensor),
which only a TorchFunctionMode sees.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .errors import DEVICE_TO_HOST, HOST_SYNC, HOST_TENSOR, HOST_TO_DEVICE, RNG

_aten = torch.ops.aten

# Ops that return a host value computed from device data. Most carry
# Tag.data_dependent_output; listing them by name as well keeps us honest if the
# tags move between torch versions.
_HOST_SYNC_PACKETS = frozenset(
    {_aten._local_scalar_dense, _aten.item, _aten.is_nonzero, _aten.equal}
)

# Ops whose data-dependence depends on the index dtype: integer indexing is fine in a
# graph, boolean masks are a hidden nonzero().
_MASK_INDEX_PACKETS = frozenset({_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_})

# Copies that may move device memory to the host (the destination decides).
_COPY_PACKETS = frozenset({_aten.copy_, _aten.copy, _aten._copy_from, _aten._copy_from_and_resize})

# A tensor that torch filled from Python data, handed to the dispatcher (torch.tensor, as_tensor).
_LIFT_PACKETS = frozenset({_aten.lift_fresh, _aten.lift_fresh_copy, _aten.lift})

# Tensor methods that read storage on the host without any aten op.
_HOST_READ_METHODS = frozenset({"tolist", "numpy", "__array__"})


def _has_bool_index(indices: Any) -> bool:
    return any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
        for t in tree_leaves(indices)
    )


def _is_host(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _device_to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    packet = func.overloadpacket
    if packet is _aten._to_copy:
        src = args[0]
        dst = kwargs.get("device")
        return isinstance(src, torch.Tensor) and _is_host(dst) and not _is_host(src.device)
    if packet in _COPY_PACKETS and len(args) >= 2:
        if packet is _aten.copy_:
            dst, src = args[0], args[1]
        elif packet is _aten.copy:
            return False  # functional copy: result lives on self's device, no host read
        else:  # _copy_from(self=src, dst)
            src, dst = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return (
            isinstance(src, torch.Tensor)
            and isinstance(dst, torch.Tensor)
            and _is_host(dst.device)
            and not _is_host(src.device)
            # Into pinned memory without blocking, the copy is an asynchronous memcpy a CUDA graph records
            # (what CPU offload's D2H of grads does); only a later host read of the target needs a wait.
            and not (non_blocking and dst.is_pinned())
        )
    return False


def _host_to_device(func: Any, args: tuple, kwargs: dict) -> bool:
    """A copy from CPU memory to another device, unless non_blocking from pinned memory."""
    packet = func.overloadpacket
    if packet is _aten._to_copy:
        src, dst, non_blocking = args[0], kwargs.get("device"), kwargs.get("non_blocking", False)
        if not isinstance(src, torch.Tensor) or dst is None:
            return False
    elif packet is _aten.copy_ and len(args) >= 2:
        dst_t, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if not (isinstance(src, torch.Tensor) and isinstance(dst_t, torch.Tensor)):
            return False
        dst = dst_t.device
    elif packet is _aten._copy_from and len(args) >= 2:
        src, dst_t = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if not (isinstance(src, torch.Tensor) and isinstance(dst_t, torch.Tensor)):
            return False
        dst = dst_t.device
    else:
        return False
    if not _is_host(src.device) or _is_host(dst):
        return False
    return not (non_blocking and src.is_pinned())


def classify(func: Any, args: tuple, kwargs: dict) -> Optional[str]:
    """The Finding kind of one aten op call, or None when it is capture-safe."""
    tags = getattr(func, "tags", ())
    packet = getattr(func, "overloadpacket", None)
    if packet in _HOST_SYNC_PACKETS or torch.Tag.data_dependent_output in tags:
        return HOST_SYNC
    if packet in _MASK_INDEX_PACKETS:
        if _has_bool_index(args[1:2]) or _has_bool_index(kwargs.get("indices")):
            return HOST_SYNC
    elif torch.Tag.dynamic_output_shape in tags:
        return HOST_SYNC
    if packet is not None and _device_to_host(func, args, kwargs):
        return DEVICE_TO_HOST
    if packet in _LIFT_PACKETS:
        return HOST_TENSOR
    if packet is not None and _host_to_device(func, args, kwargs):
        return HOST_TO_DEVICE
    if torch.Tag.nondeterministic_seeded in tags:
        return RNG
    return None


def op_name(func: Any) -> str:
    """'aten.add_.Tensor' for an OpOverload, 'Tensor.tolist' for a Tensor method."""
    if hasattr(func, "overloadpacket"):
        return str(func)
    return f"Tensor.{getattr(func, '__name__', repr(func))}"


class HostReadMode(TorchFunctionMode):
    """Calls `on_host_read(func)` for Tensor methods that read storage on the host.

    The callback may raise (the replay recorder does) or just note it (check does); if
    it returns, the method runs normally.
    """

    def __init__(self, on_host_read: Callable[[Any], None]):
        super().__init__()
        self._on_host_read = on_host_read
        # True while a reported method runs: on a device tensor `.tolist()` dispatches
        # a `_to_copy` to the CPU, the same event, which should not be reported twice.
        self.inside = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.inside or getattr(func, "__name__", None) not in _HOST_READ_METHODS:
            return func(*args, **(kwargs or {}))
        self._on_host_read(func)
        self.inside = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.inside = False
