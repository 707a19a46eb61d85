"""The CUDA backend's CPU-testable parts: the NCCL environment check, device choice, capture mode.

The capture itself needs a GPU (tests/cuda); what it decides before touching CUDA is tested here.
"""
import contextlib

import pytest
import torch

import capture
from capture.backends import CaptureOptions
from capture.backends import cuda as cuda_backend
from capture.backends.cuda import CudaBackend, check_nccl_capture_environment


@pytest.mark.parametrize("env", [
    {},
    {"TORCH_NCCL_BLOCKING_WAIT": "0"},
    {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_GRAPH_REGISTER": "0"},
    {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False,max_split_size_mb:128"},
    {"NCCL_GRAPH_REGISTER": "1"},  # registration without expandable segments is NCCL's default
])
def test_environments_that_capture_nccl_are_accepted(env):
    check_nccl_capture_environment(env)


def test_blocking_wait_is_refused_with_what_to_set():
    with pytest.raises(capture.CaptureError) as info:
        check_nccl_capture_environment({"TORCH_NCCL_BLOCKING_WAIT": "1"})
    assert "TORCH_NCCL_BLOCKING_WAIT=1" in str(info.value) and "unset it" in str(info.value)
    with pytest.raises(capture.CaptureError, match="NCCL_BLOCKING_WAIT=true"):
        check_nccl_capture_environment({"NCCL_BLOCKING_WAIT": "true"})


@pytest.mark.parametrize("register", [None, "1"])
@pytest.mark.parametrize("conf_name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_graph_registration_with_expandable_segments_is_refused(register, conf_name):
    env = {conf_name: "max_split_size_mb:64,expandable_segments:True"}
    if register is not None:
        env["NCCL_GRAPH_REGISTER"] = register
    with pytest.raises(capture.CaptureError) as info:
        check_nccl_capture_environment(env)
    msg = str(info.value)
    assert "NCCL_GRAPH_REGISTER=0" in msg and conf_name in msg
    assert ("unset (on)" in msg) == (register is None)


def test_expandable_segments_turned_on_at_run_time_are_refused_too():
    # A framework may switch expandable segments on after start-up; the environment variables then say nothing.
    with pytest.raises(capture.CaptureError, match="expandable_segments in the allocator's settings at run time"):
        check_nccl_capture_environment({}, allocator="expandable_segments:True")
    check_nccl_capture_environment({"NCCL_GRAPH_REGISTER": "0"}, allocator="expandable_segments:True")  # allowed
    check_nccl_capture_environment({}, allocator="max_split_size_mb:64")


@pytest.mark.skipif(not hasattr(torch._C, "_accelerator_getAllocatorSettings"),
                    reason="this torch has no _accelerator_getAllocatorSettings (torch 2.11): graphstep reads none")
def test_the_allocator_settings_are_read_from_torch():
    torch._C._accelerator_setAllocatorSettings("expandable_segments:False")
    assert "expandable_segments" in cuda_backend.allocator_settings()


def test_every_problem_is_listed_at_once():
    env = {"TORCH_NCCL_BLOCKING_WAIT": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with pytest.raises(capture.CaptureError) as info:
        check_nccl_capture_environment(env)
    assert "BLOCKING_WAIT" in str(info.value) and "expandable_segments" in str(info.value)


class _FakeCuda:
    """Stand-ins for the torch.cuda objects the backend's capture touches, recording how it calls them."""

    def __init__(self, monkeypatch):
        self.events = []
        fake = self

        class Stream:
            def __init__(self, device=None):
                fake.events.append(("stream", device))

        class CUDAGraph:
            def replay(self):
                fake.events.append(("replay",))

            def reset(self):
                fake.events.append(("reset",))

        class CurrentStream:
            def synchronize(self):
                fake.events.append(("synchronize",))

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None, capture_error_mode="global"):
            fake.events.append(("graph", capture_error_mode))
            try:
                yield
            except BaseException:
                # what torch.cuda.graph's exit does after a failed capture: capture_end raises its own error
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

        @contextlib.contextmanager
        def device_scope(device):
            fake.events.append(("enter", device))
            yield
            fake.events.append(("exit", device))

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: CurrentStream())
        monkeypatch.setattr(cuda_backend, "device_scope", device_scope)


def test_capture_is_thread_local_under_the_steps_device(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    backend = CudaBackend(options=CaptureOptions(device="cuda:2"))
    out = backend.capture(lambda: fake.events.append(("fn",)) or "result")
    dev = torch.device("cuda", 2)
    assert out == "result"
    assert fake.events == [("enter", dev), ("stream", dev), ("graph", "thread_local"), ("fn",), ("replay",),
                           ("exit", dev)]


def test_the_error_raised_inside_the_capture_is_reported_not_capture_ends(monkeypatch):
    _FakeCuda(monkeypatch)
    backend = CudaBackend(options=CaptureOptions(device="cuda:0"))

    def step():
        raise ValueError("the step's own error")

    with pytest.raises(ValueError, match="the step's own error") as raised:
        backend.capture(step)
    assert "previous error during capture" in str(raised.value.__cause__)  # kept, as the consequence


def test_close_releases_the_graph_the_side_stream_and_the_pool(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    pool = object()
    backend = CudaBackend(pool=pool, options=CaptureOptions(device="cuda:0"))
    backend.capture(lambda: None)
    fake.events.clear()
    backend.close()
    assert ("synchronize",) in fake.events and ("reset",) in fake.events  # queued replays end first
    assert (backend._graph, backend._stream, backend._pool) == (None, None, None)  # nothing held any more


def test_capture_checks_the_nccl_environment_when_nccl_is_initialised(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    backend = CudaBackend(options=CaptureOptions(device="cuda:0"))
    backend.capture(lambda: None)  # no NCCL group: nothing to check
    monkeypatch.setattr(cuda_backend, "_nccl_initialised", lambda: True)
    fake.events.clear()
    with pytest.raises(capture.CaptureError, match="TORCH_NCCL_BLOCKING_WAIT=1"):
        backend.capture(lambda: None)
    assert fake.events == []  # refused before touching the device
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT")
    monkeypatch.setattr(cuda_backend, "allocator_settings", lambda: "expandable_segments:True")
    with pytest.raises(capture.CaptureError, match="at run time"):
        backend.capture(lambda: None)


def test_the_steps_device_comes_from_the_options_then_the_static_inputs():
    assert CudaBackend(options=CaptureOptions(device="cuda:1")).device() == torch.device("cuda", 1)
    seen = []
    backend = CudaBackend(options=CaptureOptions(device=lambda: seen.append(1) or torch.device("cuda", 3)))
    assert backend.device() == torch.device("cuda", 3) and backend.device() == torch.device("cuda", 3)
    assert seen == [1]  # decided once
    # capture.graph hands the backend the first static input's device.
    x = torch.zeros(2)
    g = capture.graph(lambda: x.add_(1), backend="replay", static_inputs={"x": x})
    assert g._backend._options.device() == x.device


def test_a_device_not_known_before_the_warm_up_is_decided_once_it_is(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    state = {}  # what the warm-up creates
    g = capture.graph(lambda: None, backend="replay", static_inputs=lambda: {"buf": state["buf"]})
    backend = CudaBackend(options=g._backend._options)
    assert backend.device() == torch.device("cuda", 0)  # the callable cannot be evaluated yet
    state["buf"] = torch.empty(1, device="meta")
    assert backend.device() == torch.device("meta")
    state["buf"] = torch.empty(1)
    assert backend.device() == torch.device("meta")  # kept once known
