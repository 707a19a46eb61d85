"""The micro-batches of an iteration as static tensors: one set per input signature, copied into before each run.

A captured iteration reads its inputs at fixed addresses, so every batch is copied into tensors allocated once
for its *signature*: the structure of the micro-batches (how many, how each nests its tensors), each tensor's
shape and dtype, and the value of every non-tensor leaf (an int, a string: Python values the forward bakes in).
Another signature is another set of buffers, and another graph: a shape is never padded to one seen before.

The static tensors live on the iteration's device. On an accelerator a host tensor is first copied into pinned
host memory owned by the buffers (unless it is pinned already), then to the device without blocking the host.
Before the pinned memory is written again the host waits for the copy that last read it, which normally
finished long before. On CUDA that copy runs on a side stream, overlapping the previous iteration's replay
(``SideStreamCopy``); on another accelerator it is queued on the current stream, after the previous iteration.
On the CPU a batch is copied directly.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from capture.devices import accelerator_available, is_cuda


def signature(micro_batches: Sequence[Any]) -> tuple:
    """What must match for a captured iteration to run ``micro_batches``: structure, shapes, dtypes, values."""
    leaves, spec = tree_flatten(list(micro_batches))
    described = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            described.append((tuple(leaf.shape), leaf.dtype))
        else:
            try:
                hash(leaf)
            except TypeError:
                raise TypeError(f"graphstep.Iteration: a batch holds a {type(leaf).__name__}, which is neither a "
                                "tensor nor a hashable Python value; pass tensors (lists, tuples and dicts of them "
                                "are fine)") from None
            described.append(("value", leaf))
    return (str(spec), tuple(described))


def describe(key: tuple) -> str:
    """A signature in words: each distinct dtype and shape, preceded by how many tensors have it when several."""
    shapes = [f"{str(d[1]).replace('torch.', '')}{list(d[0])}" for d in key[1] if d[0] != "value"]
    counted: dict[str, int] = {}
    for s in shapes:
        counted[s] = counted.get(s, 0) + 1
    return ", ".join(f"{n} x {s}" if n > 1 else s for s, n in counted.items()) or "no tensors"


class StaticBatch:
    """The static tensors of one signature; ``copy_in`` fills them, ``micro_batches`` is what the graph reads."""

    def __init__(self, micro_batches: Sequence[Any], device: torch.device):
        leaves, self._spec = tree_flatten(list(micro_batches))
        self._is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.tensors = [torch.empty(x.shape, dtype=x.dtype, device=device) for x in leaves
                        if isinstance(x, torch.Tensor)]
        static = iter(self.tensors)
        self.micro_batches = tree_unflatten([next(static) if t else x for x, t in zip(leaves, self._is_tensor)],
                                            self._spec)
        self.pins = device.type != "cpu" and accelerator_available()
        """Whether host tensors go through pinned memory (on an accelerator)."""
        self._side = SideStreamCopy(device, len(self.tensors)) if self.pins and is_cuda(device) else None
        self._staging: list[Optional[torch.Tensor]] = [None] * len(self.tensors)
        self._copied: Optional[Any] = None  # the event after the last copy out of the pinned memory

    @property
    def side_stream(self) -> Optional[Any]:
        """The stream host batches are copied to the device on (CUDA), or None (copied on the current stream)."""
        return None if self._side is None else self._side.stream

    def named(self, prefix: str) -> dict:
        return {f"{prefix}[{i}]": t for i, t in enumerate(self.tensors)}

    def copy_in(self, micro_batches: Sequence[Any]) -> None:
        leaves = [x for x in tree_flatten(list(micro_batches))[0] if isinstance(x, torch.Tensor)]
        if not self.pins:
            with torch.no_grad():
                for static, x in zip(self.tensors, leaves):
                    static.copy_(x)
            return
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the pinned memory we are about to write
        with torch.no_grad():
            sources = [self._pinned(i, x) for i, x in enumerate(leaves)]
            if self._side is not None:
                # None: no host leaf this time, and the last event still marks the pinned memory's last read.
                self._copied = self._side.copy(self.tensors, sources) or self._copied
                return
            for static, x in zip(self.tensors, sources):
                static.copy_(x, non_blocking=True)
        self._copied = torch.Event(self.tensors[0].device) if self.tensors else None
        if self._copied is not None:
            self._copied.record()

    def _pinned(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """``x``, or a host tensor in pageable memory copied into this leaf's pinned staging tensor."""
        if x.device.type != "cpu" or x.is_pinned():
            return x
        if self._staging[i] is None:
            self._staging[i] = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        self._staging[i].copy_(x)
        return self._staging[i]


class SideStreamCopy:
    """Host tensors copied to the device on a side stream, so that the copy overlaps the previous replay.

    The previous iteration's graph may still be reading the static tensors, so the side stream cannot write
    them: it writes device tensors of its own (``landing``, one per host leaf), and the current stream then
    copies those into the static tensors (a device-to-device copy, queued after the previous replay, which it
    must follow). The side stream waits only until the previous batch has left its landing tensors (the event
    ``taken``, recorded on the current stream before the previous replay): so the next batch's host-to-device
    copy runs while the previous replay does. Leaves already on the device are copied on the current stream.
    """

    def __init__(self, device: torch.device, count: int):
        self.device = device
        self.stream = torch.Stream(device=device)
        self._landing: list[Optional[torch.Tensor]] = [None] * count
        self._taken: Optional[Any] = None

    def copy(self, statics: list, sources: list) -> Optional[Any]:
        """Queue the copy of ``sources`` into ``statics``; returns the event after the side stream has read the
        host sources (None when none was on the host)."""
        current = torch.accelerator.current_stream(self.device)
        on_host = [i for i, x in enumerate(sources) if x.device.type == "cpu"]
        for i in on_host:
            if self._landing[i] is None:
                self._landing[i] = torch.empty_like(statics[i])  # made on the current stream, also used on the side
                self._landing[i].record_stream(self.stream)  # freed: not reused before the side stream's copies end
        landed = None
        if on_host:
            if self._taken is not None:
                self.stream.wait_event(self._taken)  # the previous batch has left the landing tensors
            with self.stream:
                for i in on_host:
                    self._landing[i].copy_(sources[i], non_blocking=True)
            landed = torch.Event(device=self.device)
            landed.record(self.stream)
            current.wait_event(landed)
        host = set(on_host)
        for i, (static, x) in enumerate(zip(statics, sources)):
            static.copy_(self._landing[i] if i in host else x, non_blocking=True)
        self._taken = torch.Event(device=self.device)
        self._taken.record(current)
        return landed
