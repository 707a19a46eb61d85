"""Profiling hooks for any step: named ranges, an Nsight capture window, and GPU telemetry.

``ranges`` hands out context managers for named ranges: NVTX and ``torch.profiler.record_function`` ranges
when on; when off, one shared no-op context, so instrumented code pays a method call and nothing else.
``nsys_window()`` brackets a block for ``nsys profile --capture-range=cudaProfilerApi``; ``gpu_telemetry()``
reads NVML, and where there is no NVIDIA GPU returns a ``Telemetry`` whose ``error`` says so: never a crash.
Ranges are host-side: a captured step is one range around the replay; per-stage ranges need eager steps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ContextManager, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Ranges", "nsys_window", "gpu_telemetry", "Telemetry", "OpCounter"]

_OFF = contextlib.nullcontext()


def _nvtx_available() -> bool:
    return torch.cuda.is_available()


class _Range:
    __slots__ = ("name", "_record", "_nvtx")

    def __init__(self, name: str, nvtx: bool):
        self.name = name
        self._nvtx = nvtx
        self._record = None

    def __enter__(self):
        if self._nvtx:
            torch.cuda.nvtx.range_push(self.name)
        self._record = torch.profiler.record_function(self.name)
        self._record.__enter__()
        return self

    def __exit__(self, *exc):
        self._record.__exit__(*exc)
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
        return False


@dataclass
class Ranges:
    """Named ranges that cost nothing while ``enabled`` is False."""

    enabled: bool = False
    prefix: str = ""

    def __call__(self, name: str) -> ContextManager:
        if not self.enabled:
            return _OFF
        return _Range(self.prefix + name, _nvtx_available())


@contextlib.contextmanager
def nsys_window():
    """Bracket a block with cudaProfilerStart/Stop (Nsight's cudaProfilerApi capture range)."""
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


@dataclass(frozen=True)
class Telemetry:
    """One snapshot: a dict per GPU (a field NVML cannot report on this GPU holds "n/a"), or why none."""

    gpus: tuple = field(default_factory=tuple)  # one dict per GPU
    error: Optional[str] = None

    def summary(self) -> str:
        if self.error:
            return self.error
        return "\n".join(f"GPU {g['index']} {g['name']}: {_fmt(g['memory_used_mib'], '.0f')}/"
                         f"{_fmt(g['memory_total_mib'], '.0f')} MiB, SM {g['sm_clock_mhz']} MHz, "
                         f"{_fmt(g['power_w'], '.0f')} W, util {g['utilization_pct']}%"
                         for g in self.gpus)


NOT_AVAILABLE = "n/a"


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def _field(read):
    """``read()``, or "n/a" when NVML cannot report it on this GPU.

    A MIG instance reports no utilisation (NVML_ERROR_NOT_SUPPORTED), some boards no power reading;
    a snapshot is still useful without them, and telemetry must never take a run down.
    """
    try:
        return read()
    except Exception:  # NVMLError and its many subclasses, or anything a driver binding raises
        return NOT_AVAILABLE


def _gpu(pynvml, index: int) -> dict:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = _field(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    name = _field(lambda: pynvml.nvmlDeviceGetName(handle))
    return {
        "index": index,
        "name": name.decode() if isinstance(name, bytes) else name,
        "memory_used_mib": _field(lambda: memory.used / 2**20),
        "memory_total_mib": _field(lambda: memory.total / 2**20),
        "sm_clock_mhz": _field(lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
        "power_w": _field(lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
        "utilization_pct": _field(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
    }


def gpu_telemetry() -> Telemetry:
    """A snapshot of every NVIDIA GPU through NVML; never raises.

    No NVML (or no GPU): a Telemetry whose ``error`` says why. A field this GPU cannot report
    (utilisation on a MIG instance, power on some boards): "n/a" in that field. A GPU whose handle
    cannot be had at all: left out, with the reason in ``error`` if no GPU could be read.
    """
    try:
        import pynvml
    except ImportError:
        return Telemetry(error="no NVIDIA GPU telemetry (nvidia-ml-py is not installed)")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError, or a broken binding
        if isinstance(exc, getattr(pynvml, "NVMLError_LibraryNotFound", ())):
            return Telemetry(error="no NVIDIA GPU (NVML not found)")
        return Telemetry(error=f"no NVIDIA GPU (NVML: {exc})")
    try:
        gpus, failures = [], []
        try:
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:
            return Telemetry(error=f"NVML could not count the GPUs: {exc}")
        for index in range(count):
            try:
                gpus.append(_gpu(pynvml, index))
            except Exception as exc:  # no handle for this device
                failures.append(f"GPU {index}: {exc}")
        if not gpus:
            return Telemetry(error="no NVIDIA GPU (" + ("; ".join(failures) or "NVML found no devices") + ")")
        return Telemetry(gpus=tuple(gpus))
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside ``with OpCounter() as c:`` (``c.count``): on the CPU a proxy
    for kernel launches; a CUDA graph's replayed kernels and inductor's fused kernels are invisible to it
    (use torch.profiler there)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))
