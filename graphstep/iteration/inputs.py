"""The micro-batches of an iteration as static tensors: one set per input signature, copied into before each run.

A captured iteration reads its inputs at fixed addresses, so every batch is copied into tensors allocated once
for its *signature*: the structure of the micro-batches (how many, how each nests its tensors), each tensor's
shape and dtype, and the value of every non-tensor leaf (an int, a string: Python values the forward bakes in).
Another signature is another set of buffers, and another graph: a shape is never padded to one seen before.

The static tensors live on the iteration's device. On an accelerator a host tensor is first copied into pinned
host memory owned by the buffers, then to the device without blocking the host (the copy is queued on the
current stream, after the previous iteration, which may still be reading the device buffers). Before the pinned
memory is written again the host waits for the copy that last read it, which normally finished long before.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from capture.devices import accelerator_available


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
    """A signature in words: the tensors' shapes, e.g. "4 x int64[2, 16]"."""
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
        self._pinned = device.type != "cpu" and accelerator_available()
        self._staging: list[Optional[torch.Tensor]] = [None] * len(self.tensors)
        self._copied: Optional[Any] = None  # the event after the last copy out of the pinned memory

    def named(self, prefix: str) -> dict:
        return {f"{prefix}[{i}]": t for i, t in enumerate(self.tensors)}

    def copy_in(self, micro_batches: Sequence[Any]) -> None:
        leaves = [x for x in tree_flatten(list(micro_batches))[0] if isinstance(x, torch.Tensor)]
        if self._pinned and self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the pinned memory we are about to write
        with torch.no_grad():
            for i, (static, x) in enumerate(zip(self.tensors, leaves)):
                if self._pinned and x.device.type == "cpu" and not x.is_pinned():
                    if self._staging[i] is None:
                        self._staging[i] = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                    self._staging[i].copy_(x)
                    x = self._staging[i]
                static.copy_(x, non_blocking=True)
        if self._pinned:
            self._copied = torch.Event(self.tensors[0].device) if self.tensors else None
            if self._copied is not None:
                self._copied.record()
