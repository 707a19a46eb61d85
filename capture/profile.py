"""Profiling hooks for any step: named ranges, an Nsight capture window, and GPU telemetry.

- ``ranges``: a ``Ranges`` object hands out context managers for named ranges. Off (the default) it hands
  out one shared no-op context, so instrumented code pays a method call and nothing else. On, each range
  is an NVTX range on CUDA builds (what Nsight Systems shows) and a ``torch.profiler.record_function``
  range (what a torch.profiler Chrome trace shows).
- ``nsys_window()``: ``cudaProfilerStart``/``Stop`` around a block, for
  ``nsys profile --capture-range=cudaProfilerApi``; a no-op without CUDA.
- ``gpu_telemetry()``: memory, SM clock, power and utilisation per GPU through nvidia-ml-py, or a
  ``Telemetry`` whose ``error`` is "no NVIDIA GPU (NVML not found)" where there is none: never a crash.

Ranges are host-side: inside a captured graph they are not replayed, so a captured step is one range
around the replay, and per-stage ranges belong to eager steps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ContextManager, Optional

import torch

__all__ = ["Ranges", "nsys_window", "gpu_telemetry", "Telemetry"]

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
    gpus: tuple = field(default_factory=tuple)  # one dict per GPU
    error: Optional[str] = None

    def summary(self) -> str:
        if self.error:
            return self.error
        return "\n".join(f"GPU {g['index']} {g['name']}: {g['memory_used_mib']:.0f}/{g['memory_total_mib']:.0f} MiB, "
                         f"SM {g['sm_clock_mhz']} MHz, {g['power_w']:.0f} W, util {g['utilization_pct']}%"
                         for g in self.gpus)


def gpu_telemetry() -> Telemetry:
    """A snapshot of every NVIDIA GPU through NVML; an explanatory ``error`` where there is none."""
    try:
        import pynvml
    except ImportError:
        return Telemetry(error="no NVIDIA GPU telemetry (nvidia-ml-py is not installed)")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        if isinstance(exc, getattr(pynvml, "NVMLError_LibraryNotFound", ())):
            return Telemetry(error="no NVIDIA GPU (NVML not found)")
        return Telemetry(error=f"no NVIDIA GPU (NVML: {exc})")
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append({
                "index": index,
                "name": name.decode() if isinstance(name, bytes) else name,
                "memory_used_mib": memory.used / 2**20,
                "memory_total_mib": memory.total / 2**20,
                "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                "utilization_pct": pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
            })
        if not gpus:
            return Telemetry(error="no NVIDIA GPU (NVML found no devices)")
        return Telemetry(gpus=tuple(gpus))
    finally:
        pynvml.nvmlShutdown()
