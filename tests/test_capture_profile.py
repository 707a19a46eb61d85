"""capture.profile.gpu_telemetry never raises: a fake NVML module stands in for the driver."""
import sys
import types

import pytest

from capture.profile import NOT_AVAILABLE, gpu_telemetry


class _NVMLError(Exception):
    pass


class _NotSupported(_NVMLError):
    pass


def _fake_nvml(*, count=1, utilization=True, power=True, handle_fails=(), init_error=None):
    """A module with pynvml's names; MIG-like GPUs raise NotSupported for utilisation."""
    m = types.ModuleType("pynvml")
    m.NVMLError = _NVMLError
    m.NVMLError_LibraryNotFound = type("NVMLError_LibraryNotFound", (_NVMLError,), {})
    m.NVMLError_NotSupported = _NotSupported
    m.NVML_CLOCK_SM = 1
    m.calls = []

    def init():
        if init_error is not None:
            raise init_error(m)
        m.calls.append("init")

    def handle(index):
        if index in handle_fails:
            raise _NVMLError(f"no handle for {index}")
        return index

    def utilization_rates(h):
        if not utilization:
            raise _NotSupported("Not Supported")
        return types.SimpleNamespace(gpu=37)

    def power_usage(h):
        if not power:
            raise _NotSupported("Not Supported")
        return 250_000

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=2 * 2**30, total=80 * 2**30)
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    m.nvmlDeviceGetClockInfo = lambda h, clock: 1980
    m.nvmlDeviceGetPowerUsage = power_usage
    m.nvmlDeviceGetUtilizationRates = utilization_rates
    return m


def _install(monkeypatch, module):
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def test_full_gpu_reports_every_field(monkeypatch):
    nvml = _install(monkeypatch, _fake_nvml())
    t = gpu_telemetry()
    assert t.error is None and len(t.gpus) == 1
    gpu = t.gpus[0]
    assert gpu["name"] == "NVIDIA H200" and gpu["utilization_pct"] == 37 and gpu["power_w"] == 250.0
    assert gpu["memory_used_mib"] == 2048 and gpu["memory_total_mib"] == 80 * 1024
    assert "util 37%" in t.summary()
    assert nvml.calls == ["init", "shutdown"]


def test_mig_gpu_without_utilization_reports_na_instead_of_raising(monkeypatch):
    nvml = _install(monkeypatch, _fake_nvml(utilization=False, power=False))
    t = gpu_telemetry()
    assert t.error is None
    assert t.gpus[0]["utilization_pct"] == NOT_AVAILABLE and t.gpus[0]["power_w"] == NOT_AVAILABLE
    assert t.gpus[0]["sm_clock_mhz"] == 1980  # the fields it can report are still there
    summary = t.summary()
    assert "util n/a%" in summary and "n/a W" in summary
    assert nvml.calls == ["init", "shutdown"]


def test_a_gpu_without_a_handle_is_left_out_and_none_is_an_error(monkeypatch):
    _install(monkeypatch, _fake_nvml(count=2, handle_fails=(0,)))
    t = gpu_telemetry()
    assert [g["index"] for g in t.gpus] == [1]
    _install(monkeypatch, _fake_nvml(count=1, handle_fails=(0,)))
    t = gpu_telemetry()
    assert t.gpus == () and "no handle for 0" in t.error


@pytest.mark.parametrize("which", ["library", "other"])
def test_init_failure_is_an_error_message(monkeypatch, which):
    def error(m):
        return m.NVMLError_LibraryNotFound("missing") if which == "library" else _NVMLError("driver mismatch")

    _install(monkeypatch, _fake_nvml(init_error=error))
    t = gpu_telemetry()
    expected = "no NVIDIA GPU (NVML not found)" if which == "library" else "no NVIDIA GPU (NVML: driver mismatch)"
    assert t.error == expected and t.summary() == expected
