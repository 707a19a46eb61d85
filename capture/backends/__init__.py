"""Backends behind one interface (`base.Backend`), and how "auto" picks one."""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from .base import Backend, CaptureOptions
from .cuda import CudaBackend
from .eager import EagerBackend
from .replay import ReplayBackend

__all__ = ["Backend", "CaptureOptions", "CudaBackend", "EagerBackend", "ReplayBackend", "NAMES", "make_backend", "resolve"]

_BY_NAME = {cls.name: cls for cls in (CudaBackend, ReplayBackend, EagerBackend)}
NAMES = ("auto",) + tuple(_BY_NAME)


def resolve(name: str, tensors: Iterable[torch.Tensor] = ()) -> type:
    """The backend class for `name`; "auto" is the CUDA graph where usable, else replay."""
    if name == "auto":
        return CudaBackend if CudaBackend.usable(list(tensors)) else ReplayBackend
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown capture backend {name!r}; choose one of {NAMES}") from None


def make_backend(name: str, tensors: Iterable[torch.Tensor] = (), *, pool: Any = None, label: str = "step",
                 options: Optional[CaptureOptions] = None) -> Backend:
    return resolve(name, tensors)(pool=pool, label=label, options=options or CaptureOptions())
