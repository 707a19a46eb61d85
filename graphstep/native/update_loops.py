"""The compiled kernel's Adam loop over fp32 views on the CPU, as a native library (update_loops.cpp).

Bitwise the same as the ``torch.compile``d loop (graphstep/kernels/compiled.py) and as eager torch ops, which
the tests check. Its use is the start: a process that finds the library in its cache (compile_cache.py; the
first process on a machine compiles it, under a second) updates from its first step without importing
inductor or tracing with dynamo, each of which costs a process seconds even with inductor's cache warm.

``library()`` builds or loads it on its first call in a process, in that call: None where it cannot be (no
compiler, ``GRAPHSTEP_NATIVE_UPDATE=0``), and the compiled kernel then runs through
``torch.compile`` as before. ``status()`` says which, and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from . import compile_cache

SOURCE = Path(__file__).with_name("update_loops.cpp")
NAME = "graphstep_update_loops"
DISABLE_VARIABLE = "GRAPHSTEP_NATIVE_UPDATE"
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-w"]


class _Loaded:
    def __init__(self):
        self.pid = os.getpid()
        self.library = None
        self.status = "not loaded: no step has asked for it"
        self.seconds = 0.0  # the build (a compile, or a load from the cache) in this process


_loaded: Optional[_Loaded] = None
_lock = threading.Lock()
_off = False


def library():
    """The loaded library, or None where it cannot be built or is turned off (``status()`` says why)."""
    global _loaded
    if _off:
        return None
    if _loaded is None or _loaded.pid != os.getpid():
        with _lock:
            if _loaded is None or _loaded.pid != os.getpid():
                _loaded = _load()
    return _loaded.library


def status() -> str:
    """"native: <library>" once loaded; else why not."""
    if _off:
        return "torch.compile: the native update is turned off here (update_loops.off())"
    return _loaded.status if _loaded is not None else "not loaded: no step has asked for it"


def seconds() -> float:
    """Seconds this process spent finding, or compiling, and loading the library."""
    return _loaded.seconds if _loaded is not None else 0.0


@contextlib.contextmanager
def off():
    """Within, ``library()`` returns None: the compiled kernel runs through ``torch.compile`` (to compare the
    two, or to test either)."""
    global _off
    was, _off = _off, True
    try:
        yield
    finally:
        _off = was


def covers(*views: list) -> bool:
    """Whether the native loop can update these lists of views (params, grads, exp_avgs, exp_avg_sqs; one
    tensor of each per view): all fp32, contiguous, on the CPU, each view's four of one length."""
    first = views[0]
    if not first or any(len(other) != len(first) for other in views):
        return False
    for tensors in zip(*views):
        numel = tensors[0].numel()
        for tensor in tensors:
            if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous() \
                    or tensor.numel() != numel:
                return False
    return True


def adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
         coefficients: torch.Tensor) -> None:
    """One view's Adam step in place (``covers`` holds for it), from one fp32 row of the compiled kernel's
    coefficients (graphstep/kernels/adam_coefficients.py), with torch's thread count."""
    if coefficients.dtype != torch.float32 or coefficients.device.type != "cpu" or not coefficients.is_contiguous():
        raise ValueError("coefficients must be one contiguous fp32 CPU row")
    library().graphstep_adam_fp32(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                                  param.numel(), coefficients.data_ptr(), torch.get_num_threads())


def _load() -> _Loaded:
    loaded = _Loaded()
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        loaded.status = f"torch.compile: {DISABLE_VARIABLE}=0"
        return loaded
    start = time.perf_counter()
    try:
        path = compile_cache.cached_library(SOURCE, NAME, _FLAGS, [], torch_headers=False)
        library = ctypes.CDLL(str(path))
        function = library.graphstep_adam_fp32
        function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        function.restype = None
        loaded.library, loaded.status = library, f"native: {path}"
    except Exception as error:  # noqa: BLE001 - any failure leaves the update to torch.compile, and says why
        loaded.status = f"torch.compile: the native update could not be built ({type(error).__name__}: {error})"
    loaded.seconds = time.perf_counter() - start
    return loaded
