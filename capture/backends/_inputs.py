"""How the replay backend refers to the tensors a step read that existed before the capture.

A CUDA graph keeps raw addresses, not tensors: freed memory is read anyway, and a tensor given new memory
(``p.data = new``) is not seen. The replay backend mirrors that strictly instead of being kinder: it holds each
such tensor weakly (its object and its storage), and before each replay checks that the storage is alive and
the tensor still describes the captured memory (data pointer, shape, stride, dtype). Either failure raises
``StaleInputError`` naming the tensor by the op and source line that first read it, before any op runs. A view
whose object died while its storage lives on is rebuilt from the storage, as the graph would still read valid
memory. New memory at the old address with the old layout is what the graph reads anyway, so it passes. A
tensor over a storage the step itself resizes (``follow_storages``) is matched by storage instead: its address
moves at each replay, as the step frees and allocates it (``_storage.py``).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import StaleInputError
from ._storage import storage_id

_ADVICE = ("a captured step keeps raw addresses (as a CUDA graph does), so it would read freed or stale memory; "
           "keep the tensors a captured step reads alive and in place, or invalidate() and capture again")


class WeakInputs:
    """The pre-existing tensors of one recorded step, held weakly; `fetch()` returns them all or raises."""

    def __init__(self) -> None:
        self.handles: list[InputHandle] = []
        self._refs: list[weakref.ref] = []
        self._signatures: list[tuple] = []
        self._follows = False  # whether some handle is matched by storage

    def add(self, t: torch.Tensor, where: str) -> int:
        """Hold `t` weakly; its index in `fetch()`'s list."""
        handle = InputHandle(t, where)
        self.handles.append(handle)
        self._refs.append(handle.ref)
        self._signatures.append(handle.signature)
        return len(self.handles) - 1

    def follow_storages(self, storage_ids: set) -> None:
        """Match the tensors over these storages (ids: ``_storage.storage_id``) by storage, not address."""
        for i, handle in enumerate(self.handles):
            if handle.storage_id in storage_ids:
                handle.follow_storage()
                self._signatures[i] = handle.signature
                self._follows = True

    def __len__(self) -> int:
        return len(self.handles)

    def fetch(self) -> list:
        """Every input tensor, in `add` order; StaleInputError naming the first freed or replaced one."""
        tensors = [ref() for ref in self._refs]
        try:
            if self._follows:
                signatures = [handle.signature_of(t) for handle, t in zip(self.handles, tensors)]
            else:
                signatures = [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors]
        except AttributeError:  # an object is gone (None has no data_ptr): the per-handle path
            return [handle.get() for handle in self.handles]
        if signatures != self._signatures:
            for handle in self.handles:
                handle.get()  # raises for the first replaced one
        return tensors


class InputHandle:
    """A weak hold on one pre-existing tensor of a recorded step; `get()` returns it or raises."""

    __slots__ = ("where", "ref", "data_ptr", "signature", "storage_id", "follows", "_storage_ref", "_size", "_stride",
                 "_offset", "_dtype", "_device")

    def __init__(self, t: torch.Tensor, where: str) -> None:
        self.where = where  # "float32[4, 3] on cpu first read by aten.add_.Tensor at step.py:12 (p.add_(g))"
        self.ref: weakref.ref = weakref.ref(t)
        self.data_ptr = t.data_ptr()
        self._storage_ref = _storage_ref(t)
        self._size, self._stride, self._offset = tuple(t.size()), tuple(t.stride()), t.storage_offset()
        self._dtype, self._device = t.dtype, t.device
        self.storage_id = self._storage_ref.cdata if self._storage_ref is not None else None
        self.follows = False  # matched by storage (one the step resizes), not by address
        self.signature = self.signature_of(t)  # what fetch() compares in one pass

    def follow_storage(self) -> None:
        self.follows = True
        self.signature = (self.storage_id, self._offset, self._size, self._stride, self._dtype)

    def signature_of(self, t: torch.Tensor) -> tuple:
        if self.follows:
            return storage_id(t.untyped_storage()), t.storage_offset(), tuple(t.size()), t.stride(), t.dtype
        return t.data_ptr(), t.shape, t.stride(), t.dtype

    def get(self) -> torch.Tensor:
        t = self.ref()
        if t is not None:
            if self.signature_of(t) != self.signature:
                raise StaleInputError(f"a tensor the captured step reads was replaced after capture: {self.where}, "
                                      f"now {_describe(t)} stride {tuple(t.stride())} at 0x{t.data_ptr():x} (was "
                                      f"0x{self.data_ptr:x}); {_ADVICE}")
            return t
        rebuilt = self._from_storage()
        if rebuilt is None:
            raise StaleInputError(f"a tensor the captured step reads was freed after capture: {self.where}; {_ADVICE}")
        return rebuilt

    def _from_storage(self) -> Optional[torch.Tensor]:
        if self._storage_ref is None or self._storage_ref.expired():
            return None
        storage = torch.UntypedStorage._new_with_weak_ptr(self._storage_ref.cdata)
        if storage is None:
            return None
        view = torch.empty(0, dtype=self._dtype, device=self._device)
        with torch.no_grad():
            view.set_(storage, self._offset, self._size, self._stride)
        return view


def _storage_ref(t: torch.Tensor) -> Optional[StorageWeakRef]:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, functional wrappers)
        return None


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def describe_first_use(t: torch.Tensor, op: str, location: tuple) -> str:
    filename, lineno, line = location
    return f"{_describe(t)} on {t.device} first read by {op} at {filename}:{lineno} ({line})"
