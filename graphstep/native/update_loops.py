"""The compiled kernels' Adam loops on the CPU, as a native library (update_loops.cpp): over fp32 views, and over
main params and moments stored in bf16 or as bf16 params with remainders.

Bitwise the same as the ``torch.compile``d loops (graphstep/kernels/compiled.py, compiled_stored.py) and as eager
torch ops, which the tests check. Why: a process that finds the library in its cache (compile_cache.py; the first
process on a machine compiles it, under a second) updates from its first step without importing inductor or
tracing with dynamo, each of which costs a process seconds even with inductor's cache warm; and inductor's loop
over 16-bit state updated in place next to fp32 is slower than the fp32 step, where its bytes say it should be
faster (docs/performance.md).

``library()`` builds or loads it on its first call in a process, in that call: None where it cannot be (no
compiler, ``GRAPHSTEP_NATIVE_UPDATE=0``), and the compiled kernels then run through ``torch.compile`` as before.
``status()`` says which, and why.
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
        self.compile_s = 0.0  # seconds this process spent compiling it, or waiting for another process's compile
        self.compile_reported = False


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


def unreported_compile_seconds() -> float:
    """The seconds this process spent building the library (0 where a process before it had: found in the
    cache), once: a later call returns 0, as a second build in the process compiles nothing."""
    loaded = _loaded if _loaded is not None and _loaded.pid == os.getpid() else None
    if loaded is None or loaded.compile_reported:
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
    _check_row(coefficients)
    library().graphstep_adam_fp32(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                                  param.numel(), coefficients.data_ptr(), torch.get_num_threads())


# compiled_stored.py's encodings the native loop takes (update_loops.cpp's ``Encoding``), each with the dtypes of
# its tensors: the main params' (f32, or bf16 params with remainders: two int16 tensors), the moments' (f32,
# bf16), the grads' (fp32 or bf16).
_STORED = {"f32": (0, (torch.float32,)), "bf16": (1, (torch.bfloat16,)), "rem": (2, (torch.int16, torch.int16))}
_GRADS = {torch.float32: 0, torch.bfloat16: 1}


def stored_covers(encodings: tuple, stored: tuple, grad: torch.Tensor) -> bool:
    """Whether the native loop can update one part stored with ``encodings`` (main params, exp_avg, exp_avg_sq;
    compiled_stored.py's codes) in ``stored`` (per kind its tensors), reading ``grad``: codes it takes, tensors
    of their dtypes, contiguous, on the CPU, all of one length."""
    main, exp_avg, exp_avg_sq = encodings
    if main not in ("f32", "rem") or {exp_avg, exp_avg_sq} - {"f32", "bf16"} or grad.dtype not in _GRADS:
        return False
    tensors = [grad, *(t for kind in stored for t in kind)]
    dtypes = [grad.dtype, *(d for code in encodings for d in _STORED[code][1])]
    return len(tensors) == len(dtypes) and all(
        t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() and t.numel() == grad.numel()
        for t, dtype in zip(tensors, dtypes))


def adam_stored(encodings: tuple, stored: tuple, grad: torch.Tensor, coefficients: torch.Tensor) -> None:
    """One part's Adam in place over its stored main params and moments (``stored_covers`` holds for it), from
    one fp32 row of coefficients, with torch's thread count."""
    _check_row(coefficients)
    (main, *main_low), (exp_avg,), (exp_avg_sq,) = stored
    codes = [_STORED[code][0] for code in encodings]
    failed = library().graphstep_adam_stored(
        main.data_ptr(), main_low[0].data_ptr() if main_low else None, codes[0], exp_avg.data_ptr(), codes[1],
        exp_avg_sq.data_ptr(), codes[2], grad.data_ptr(), _GRADS[grad.dtype], grad.numel(),
        coefficients.data_ptr(), torch.get_num_threads())
    if failed:
        raise ValueError(f"the native loop takes no encodings {encodings} with {grad.dtype} grads")


# The scaled encodings (update_loops.cpp's ``ScaledEncoding``) and their dtypes, for ``graphstep_adam_scaled``.
_SCALED = {**_STORED, "f16": (3, (torch.float16,)), "f8": (4, (torch.uint8,))}


def scaled_covers(encodings: tuple, stored: tuple, grad: torch.Tensor, index: tuple, scales: tuple) -> bool:
    """Whether ``adam_scaled`` can run one part stored with ``encodings`` (main params f32 / rem / f16; moments
    f32 / bf16 / f16 / f8) in ``stored``, reading ``grad`` (fp32 or bf16), with the part's ``index`` (per row its
    first piece, second piece, split) and per kind its pieces' ``scales`` (None where unscaled): all on the CPU,
    contiguous, of their dtypes and lengths."""
    main, exp_avg, exp_avg_sq = encodings
    if main not in ("f32", "rem", "f16") or {exp_avg, exp_avg_sq} - {"f32", "bf16", "f16", "f8"} \
            or grad.dtype not in _GRADS or grad.dim() != 2:
        return False
    tensors = [grad, *(t for kind in stored for t in kind)]
    dtypes = [grad.dtype, *(d for code in encodings for d in _SCALED[code][1])]
    first, second, split = index
    rows = grad.shape[0]
    return (len(tensors) == len(dtypes)
            and all(t.dtype == dtype and t.shape == grad.shape for t, dtype in zip(tensors, dtypes))
            and all(t.dtype == torch.int64 and t.shape == (rows,) for t in (first, second))
            and split.dtype == torch.float32 and split.shape == (rows,)
            and all(s is None or s.dtype == torch.float32 and s.dim() == 1 for s in scales)
            and all(t.device.type == "cpu" and t.is_contiguous()
                    for t in (*tensors, *index, *(s for s in scales if s is not None))))


def adam_scaled(pass_: int, encodings: tuple, stored: tuple, grad: torch.Tensor, index: tuple, scales: tuple,
                out: tuple, fp8_values: torch.Tensor, infinite: tuple, coefficients: torch.Tensor) -> None:
    """One pass of one part (``scaled_covers`` holds for it) over its pieces: pass 1 raises ``out[k]`` (per piece,
    for each scaled kind k) to the largest magnitude of the kind's new values, NaN counting 0 and inf
    ``infinite[k]``; pass 2 stores the new values, kind k scaled by ``out[k]`` (per piece, 1 / its new scale).
    ``scales[k]``: per piece, the scale kind k is stored with now; None where unscaled (``out[k]`` None too)."""
    _check_row(coefficients)
    (main, *main_low), (exp_avg,), (exp_avg_sq,) = stored
    pointers = (ctypes.c_void_p * 3)(*(t.data_ptr() for t in (main, exp_avg, exp_avg_sq)))
    codes = (ctypes.c_int * 3)(*(_SCALED[code][0] for code in encodings))
    scale_pointers = (ctypes.c_void_p * 3)(*(None if s is None else s.data_ptr() for s in scales))
    out_pointers = (ctypes.c_void_p * 3)(*(None if o is None else o.data_ptr() for o in out))
    infinities = (ctypes.c_float * 3)(*infinite)
    first, second, split = index
    pieces = max((s.numel() for s in scales if s is not None), default=0)
    failed = library().graphstep_adam_scaled(
        pass_, pointers, main_low[0].data_ptr() if main_low else None, codes, scale_pointers, grad.data_ptr(),
        _GRADS[grad.dtype], grad.shape[0], grad.shape[1], first.data_ptr(), second.data_ptr(), split.data_ptr(),
        pieces, out_pointers, fp8_values.data_ptr(), infinities, coefficients.data_ptr(), torch.get_num_threads())
    if failed:
        raise ValueError(f"the native loop takes no encodings {encodings} with {grad.dtype} grads")


def _check_row(coefficients: torch.Tensor) -> None:
    if coefficients.dtype != torch.float32 or coefficients.device.type != "cpu" or not coefficients.is_contiguous():
        raise ValueError("coefficients must be one contiguous fp32 CPU row")


def _load() -> _Loaded:
    loaded = _Loaded()
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        loaded.status = f"torch.compile: {DISABLE_VARIABLE}=0"
        return loaded
    try:
        started, cached = time.perf_counter(), compile_cache.library_path(SOURCE, NAME, _FLAGS).exists()
        path = compile_cache.cached_library(SOURCE, NAME, _FLAGS, [], torch_headers=False)
        loaded.compile_s = 0.0 if cached else time.perf_counter() - started
        library = ctypes.CDLL(str(path))
        function = library.graphstep_adam_fp32
        function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        function.restype = None
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
        loaded.library, loaded.status = library, f"native: {path}"
    except Exception as error:  # noqa: BLE001 - any failure leaves the update to torch.compile, and says why
        loaded.status = f"torch.compile: the native update could not be built ({type(error).__name__}: {error})"
    return loaded
