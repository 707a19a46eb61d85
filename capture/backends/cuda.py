"""The CUDA backend: torch.cuda.CUDAGraph, owned by one Graph object. Nothing touches CUDA at import time.

Choices, and why: warm-up runs on the side stream the capture later uses, so lazy work (cuBLAS handles,
allocator growth, optimizer state) is done before and the capture sees the steady state. Capture uses
``capture_error_mode="thread_local"``: in torch's default "global" mode another thread touching CUDA (a
``pin_memory`` data loader) fails the capture, and NCCL's CUDA-graph guide recommends thread-local for
multi-threaded processes. Everything runs under the step's device, or a rank that never called
``set_device`` would capture on GPU 0. NCCL settings known to break captured collectives are refused first
(``check_nccl_capture_environment``). Capturing does not execute the kernels, so the graph is replayed once
right after: the capture call applies fn's effects exactly once. A step that raises while captured is reported
by its own error. Outputs live in the graph's pool and are rewritten by every replay: clone what you keep.
"""
from __future__ import annotations

import os
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional

import torch

from ..devices import device_scope, is_cuda
from ..errors import CaptureError
from .base import CaptureOptions


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _expandable_segments(conf: str) -> bool:
    """Whether an allocator config string ('key:value,key:value') turns on expandable segments."""
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments" and _truthy(value):
            return True
    return False


def allocator_settings() -> str:
    """The caching allocator's settings as this process runs with them: the environment's, or what was set
    at run time (``torch._C._accelerator_setAllocatorSettings``, e.g. expandable segments turned on by a
    framework after start-up). Empty where this torch cannot tell."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    try:
        return getter() if getter is not None else ""
    except RuntimeError:
        return ""


def check_nccl_capture_environment(env: Mapping[str, str] = os.environ, allocator: str = "") -> None:
    """Raise CaptureError if ``env`` (or ``allocator``, the allocator's settings at run time) holds a setting
    known to break a CUDA capture of NCCL collectives.

    * ``TORCH_NCCL_BLOCKING_WAIT=1`` (or the older ``NCCL_BLOCKING_WAIT``): ``Work.wait()`` then
      blocks the host until the collective has finished (torch.distributed's environment-variable
      docs), i.e. it waits on events recorded inside the capture, which cannot be waited on or
      queried while capturing (why ProcessGroupNCCL stopped handing captured work to its watchdog:
      pytorch/pytorch PR #102542).
    * ``NCCL_GRAPH_REGISTER`` enabled (NCCL's default where it is unset; "0" disables it) together
      with ``expandable_segments`` in ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` or turned on
      at run time (``allocator``, ``torch._C._accelerator_setAllocatorSettings``): under
      graph capture NCCL registers the collectives' user buffers, assuming each lies in one
      contiguous allocation (NCCL user guide, "User Buffer Registration"); expandable segments
      break that assumption, and captured collectives hang (pytorch/pytorch#158029; also
      torchtitan #3306, where CUDA graphs with expandable segments hung and passed without).
    """
    problems = []
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        if _truthy(env.get(name, "")):
            problems.append(f"{name}={env[name]} makes Work.wait() block the host on events recorded inside the "
                            f"capture; unset it (or set {name}=0) for a captured step")
    graph_register = env.get("NCCL_GRAPH_REGISTER", "").strip()
    confs = {name: env.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if allocator and not any(_expandable_segments(conf) for conf in confs.values()):
        confs["the allocator's settings at run time"] = allocator
    for conf_name, conf in confs.items():
        if graph_register != "0" and _expandable_segments(conf):
            state = f"NCCL_GRAPH_REGISTER={graph_register}" if graph_register else "NCCL_GRAPH_REGISTER unset (on)"
            problems.append(f"{state} with expandable_segments in {conf_name}: NCCL registers captured "
                            "collectives' buffers assuming one contiguous allocation, and replays can hang; set "
                            f"NCCL_GRAPH_REGISTER=0 or drop expandable_segments from {conf_name}")
    if problems:
        raise CaptureError("cannot capture a step with NCCL collectives in this environment:\n  "
                           + "\n  ".join(problems))


def _nccl_initialised() -> bool:
    """Whether the default process group uses NCCL (the captured step may then run NCCL collectives)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return "nccl" in str(dist.get_backend()).lower()


class CudaBackend:
    name: ClassVar[str] = "cuda"
    capture_runs_ops: ClassVar[bool] = False  # kernels are recorded, then replayed once the capture succeeded

    def __init__(self, *, pool: Any = None, label: str = "step", options: Optional[CaptureOptions] = None) -> None:
        self._pool = pool
        self._label = label
        self._options = options or CaptureOptions()
        self._device: Optional[torch.device] = None
        self._stream: Optional["torch.cuda.Stream"] = None
        self._stream_device: Optional[torch.device] = None
        self._graph: Optional["torch.cuda.CUDAGraph"] = None
        self._outputs: Any = None

    @staticmethod
    def usable(tensors: Iterable[torch.Tensor]) -> bool:
        """A GPU is present and every given static input lives on one."""
        if not torch.cuda.is_available():
            return False
        return all(t.device.type == "cuda" for t in tensors)

    def device(self) -> torch.device:
        """The step's device: decided once known (options.device, or the static inputs' device, which
        may only exist after the warm-up); until then the current device."""
        if self._device is not None:
            return self._device
        chosen = self._options.device
        if callable(chosen):
            chosen = chosen()
        if chosen is None:
            return torch.device("cuda", torch.cuda.current_device())
        chosen = torch.device(chosen)
        if is_cuda(chosen) and chosen.index is None:  # "cuda" means the current CUDA device
            chosen = torch.device(chosen.type, torch.cuda.current_device())
        self._device = chosen
        return chosen

    def _side_stream(self) -> "torch.cuda.Stream":
        device = self.device()
        if self._stream is None or self._stream_device != device:
            self._stream = torch.cuda.Stream(device=device)
            self._stream_device = device
        return self._stream

    def warmup(self, fn: Callable[[], Any]) -> Any:
        with device_scope(self.device()):
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out = fn()
            torch.cuda.current_stream().wait_stream(stream)
        return out

    def capture(self, fn: Callable[[], Any]) -> Any:
        if _nccl_initialised():
            check_nccl_capture_environment(allocator=allocator_settings())
        with device_scope(self.device()):
            stream = self._side_stream()
            graph = torch.cuda.CUDAGraph()
            # torch.cuda.graph synchronizes the device before capturing, so work queued
            # on the caller's stream is complete and no explicit wait is needed here.
            failure: list = []  # what fn raised, if it did: the reason, not capture_end's consequence
            try:
                with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                    try:
                        outputs = fn()
                    except BaseException as error:
                        failure.append(error)
                        raise
            except BaseException as ended:
                # Leaving the capture after fn raised ends it, and capture_end then reports "operation failed
                # due to a previous error during capture", hiding fn's own error: raise that one instead.
                if failure and ended is not failure[0]:
                    raise failure[0] from ended
                raise
            self._graph = graph
            self._outputs = outputs
            # The capture recorded the kernels without running them: run them once now.
            graph.replay()
        return outputs

    def replay(self) -> Any:
        assert self._graph is not None, "replay() before capture()"
        # CUDAGraph.replay launches on the current stream of the device it was captured on.
        self._graph.replay()
        return self._outputs

    def reset(self) -> None:
        if self._graph is not None:
            # Let queued replays finish before the graph's memory can be reused.
            with device_scope(self.device()):
                torch.cuda.current_stream().synchronize()
            self._graph.reset()
        self._graph = None
        self._outputs = None

    def close(self) -> None:
        """Drop the graph, then the side stream and the pool handle, so nothing of the step's device
        resources stays referenced (the caching allocator frees a private pool once no graph uses it)."""
        self.reset()
        self._stream = None
        self._stream_device = None
        self._pool = None

    def pool_bytes(self) -> Optional[int]:
        """Bytes of the allocator segments that belong to the captured graph's pool (reserved, not just
        in use: what the pool holds on to while the graph lives). None before a capture."""
        if self._graph is None:
            return None
        pool = tuple(self._graph.pool())
        segments = torch.cuda.memory._snapshot(self.device())["segments"]
        return sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == pool)
