"""Storage resizes inside a recorded step: recorded, so a replay frees and allocates where the step did.

``UntypedStorage.resize_`` is a method of the storage, not an op: no dispatch mode sees it. FSDP2 calls it at
every forward and backward (it allocates its unsharded params' memory before the all-gather and frees it after),
so a recorder that missed it would replay the all-gather into freed memory. ``record_resizes(on_resize)`` wraps
the method for the duration of a recording (there is no per-object hook) and calls ``on_resize(storage, nbytes)``
before each resize this thread makes. The recorder ignores those inside an op's own body, refuses those of a
temporary (replays allocate temporaries anew), and appends ``resize_storage`` with the storage, held strongly
by the program, as a CUDA graph holds its pool.

A CUDA graph replays such an allocation at the address it had during capture; here each replay allocates anew,
so the program matches the tensors viewing a resized storage by storage, not by address
(``WeakInputs.follow_storages``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch

from ._patch import SharedPatch

_state = threading.local()


def resize_storage(storage: torch.UntypedStorage, nbytes: int) -> None:
    """What a replay runs for a recorded resize (the C method itself, never the recording's wrapper)."""
    torch._C.StorageBase.resize_(storage, nbytes)


def storage_id(storage: torch.UntypedStorage) -> int:
    """The storage's identity, the same for every Python object over it and across resizes."""
    return storage._cdata


def _reporting_resize(original):
    def resize_reported(self, nbytes, *args, **kwargs):
        listeners = getattr(_state, "listeners", None)
        if listeners:
            listeners[-1](self, int(nbytes))  # before: a listener may refuse the resize
        return original(self, nbytes, *args, **kwargs)
    return resize_reported


_resize_patch = SharedPatch("resize_", _reporting_resize)


@contextlib.contextmanager
def record_resizes(on_resize: Callable[[torch.UntypedStorage, int], None]) -> Iterator[None]:
    """Call ``on_resize(storage, nbytes)`` before each ``UntypedStorage.resize_`` this thread makes in the block."""
    listeners = _state.__dict__.setdefault("listeners", [])
    listeners.append(on_resize)
    try:
        with _resize_patch.active(torch.UntypedStorage):
            yield
    finally:
        listeners.pop()
