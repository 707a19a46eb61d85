"""graphstep's native Adam loops on the CPU, as two libraries: update_loops.cpp over fp32 views (this module's
``adam``, and the grad norm's ``row_norms``), and stored_loops.cpp over main params and moments stored below fp32
(graphstep/native/stored_loops.py).

Bitwise the same as the ``torch.compile``d loops (graphstep/kernels/compiled.py, compiled_stored.py) and as eager
torch ops, which the tests check. Why: a process that finds the library in its cache (compile_cache.py; the first
process on a machine compiles it) updates from its first step without importing inductor or tracing with dynamo,
each of which costs a process seconds even with inductor's cache warm; and inductor's loop over 16-bit state
updated in place next to fp32 is slower than the fp32 step, where its bytes say it should be faster
(docs/performance.md). Two libraries, so that the fp32 one, which every fp32 model on the CPU loads, compiles in
well under a second; the stored-state one, with a loop per combination of encodings, takes seconds, once.

``library()`` and ``stored_library()`` build or load theirs on their first call in a process, in that call:
None where it cannot be (no compiler, ``GRAPHSTEP_NATIVE_UPDATE=0``), and the compiled kernels then run through
``torch.compile`` as before. ``status()`` says which, and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from . import compile_cache

SOURCE = Path(__file__).with_name("update_loops.cpp")
STORED_SOURCE = Path(__file__).with_name("stored_loops.cpp")
HEADERS = (Path(__file__).with_name("adam_element.h"),)
NAME = "graphstep_update_loops"
STORED_NAME = "graphstep_stored_loops"
DISABLE_VARIABLE = "GRAPHSTEP_NATIVE_UPDATE"
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-w"]


@dataclass
class _Loaded:
    pid: int
    library: Optional[ctypes.CDLL] = None
    status: str = "not loaded: no step has asked for it"
    compile_s: float = 0.0  # seconds this process spent compiling it, or waiting for another process's compile
    compile_reported: bool = False


_loaded: dict[str, _Loaded] = {}
_lock = threading.Lock()
_off = False


def library() -> Optional[ctypes.CDLL]:
    """The fp32 loop's library, or None where it cannot be built or is turned off (``status()`` says why)."""
    return _library(NAME)


def stored_library() -> Optional[ctypes.CDLL]:
    """The stored-state loops' library (graphstep/native/stored_loops.py), or None as ``library()``."""
    return _library(STORED_NAME)


def _library(name: str) -> Optional[ctypes.CDLL]:
    if _off:
        return None
    loaded = _loaded.get(name)
    if loaded is None or loaded.pid != os.getpid():
        with _lock:
            loaded = _loaded.get(name)
            if loaded is None or loaded.pid != os.getpid():
                loaded = _loaded[name] = _load(name)
    return loaded.library


def status(name: str = NAME) -> str:
    """"native: <library>" once loaded (``name``: NAME, the fp32 loop's, or STORED_NAME); else why not."""
    if _off:
        return "torch.compile: the native update is turned off here (update_loops.off())"
    loaded = _loaded.get(name)
    return loaded.status if loaded is not None else "not loaded: no step has asked for it"


@contextlib.contextmanager
def off():
    """Within, ``library()`` and ``stored_library()`` return None: the compiled kernel runs through
    ``torch.compile`` (to compare the two, or to test either)."""
    global _off
    was, _off = _off, True
    try:
        yield
    finally:
        _off = was


def unreported_compile_seconds() -> float:
    """The seconds this process spent building the fp32 loop's library (0 where a process before it had: found
    in the cache), once: a later call returns 0, as a second build in the process compiles nothing."""
    loaded = _loaded.get(NAME)
    if loaded is None or loaded.pid != os.getpid() or loaded.compile_reported:
        return 0.0
    loaded.compile_reported = True
    return loaded.compile_s


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
    check_row(coefficients)
    library().graphstep_adam_fp32(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                                  param.numel(), coefficients.data_ptr(), torch.get_num_threads())


def check_row(coefficients: torch.Tensor) -> None:
    """Raise unless ``coefficients`` is one contiguous fp32 CPU row, as the loops read it."""
    if coefficients.dtype != torch.float32 or coefficients.device.type != "cpu" or not coefficients.is_contiguous():
        raise ValueError("coefficients must be one contiguous fp32 CPU row")


def row_norms_cover(rows: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``row_norms`` takes these: (n, length) fp32 rows, length a multiple of 16, and (n,) fp32 norms,
    both contiguous on the CPU, and the library built."""
    return (rows.dim() == 2 and rows.dtype == torch.float32 and out.dtype == torch.float32
            and rows.device.type == "cpu" and out.device.type == "cpu" and rows.is_contiguous()
            and out.is_contiguous() and out.shape == rows.shape[:1] and rows.shape[1] % 16 == 0
            and library() is not None)


def row_norms(rows: torch.Tensor, out: torch.Tensor) -> None:
    """The fp32 norm of each row of ``rows`` into ``out`` (``row_norms_cover`` holds), with torch's thread count."""
    library().graphstep_row_norms(rows.data_ptr(), rows.shape[0], rows.shape[1], out.data_ptr(),
                                  torch.get_num_threads())


def _fp32_signatures(library: ctypes.CDLL) -> None:
    function = library.graphstep_adam_fp32
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    function.restype = None
    norms = library.graphstep_row_norms
    norms.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    norms.restype = None


def _stored_signatures(library: ctypes.CDLL) -> None:
    stored = library.graphstep_adam_stored
    stored.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p, ctypes.c_int] * 3 + \
        [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    stored.restype = ctypes.c_int
    scaled = library.graphstep_adam_scaled
    scaled.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    scaled.restype = ctypes.c_int
    for cast in ("graphstep_to_e4m3", "graphstep_to_f16", "graphstep_from_f16"):
        getattr(library, cast).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]


_SOURCES: dict[str, tuple[Path, Callable[[ctypes.CDLL], None]]] = {
    NAME: (SOURCE, _fp32_signatures), STORED_NAME: (STORED_SOURCE, _stored_signatures)}


def _load(name: str) -> _Loaded:
    loaded = _Loaded(os.getpid())
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        loaded.status = f"torch.compile: {DISABLE_VARIABLE}=0"
        return loaded
    source, signatures = _SOURCES[name]
    try:
        started = time.perf_counter()
        cached = compile_cache.library_path(source, name, _FLAGS, includes=HEADERS).exists()
        path = compile_cache.cached_library(source, name, _FLAGS, [], torch_headers=False, includes=HEADERS)
        loaded.compile_s = 0.0 if cached else time.perf_counter() - started
        library = ctypes.CDLL(str(path))
        signatures(library)
        loaded.library, loaded.status = library, f"native: {path}"
    except Exception as error:  # noqa: BLE001 - any failure leaves the update to torch.compile, and says why
        loaded.status = f"torch.compile: the native update could not be built ({type(error).__name__}: {error})"
    return loaded
