"""The CUDA backend: torch.cuda.CUDAGraph, owned by one Graph object.

Nothing here touches CUDA at import time: a CPU-only torch must be able to import
capture. The stream and graph are created on first use.

Choices, and why:
* Warm-up runs on a side stream, the same stream the capture later uses. The first
  calls of a step do lazy work (cuBLAS handles and workspaces, autograd-free caching
  allocator growth, optimizer state created on first step); doing it on the capture
  stream means the capture sees the step in its steady state. The side stream waits on
  the caller's current stream before, and the caller's stream waits on it after, so
  ordering with surrounding work is what the caller wrote.
* Capture uses `torch.cuda.graph(graph, pool=..., stream=...)`, which synchronizes,
  collects garbage and captures in "global" error mode, so a stray sync anywhere in
  the process fails loudly instead of producing a broken graph.
* `pool`: None gives the graph its own private memory pool. Pass a
  `torch.cuda.graph_pool_handle()` to share one pool between several graphs (less
  memory); they must then be replayed in the order they were captured, since each one
  may reuse memory the previous one freed.
* Capturing does not execute the kernels. We replay once right after capturing, so the
  capture call applies fn's effects exactly once, like the replay backend's recording
  and like every other call. (Warm-up calls are real steps too.)
* Outputs: the tensors fn returned during capture live in the graph's pool; every
  replay rewrites them in place. They are graph-owned: clone what you keep.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable, Optional

import torch


class CudaBackend:
    name: ClassVar[str] = "cuda"

    def __init__(self, *, pool: Any = None, label: str = "step") -> None:
        self._pool = pool
        self._label = label
        self._stream: Optional["torch.cuda.Stream"] = None
        self._graph: Optional["torch.cuda.CUDAGraph"] = None
        self._outputs: Any = None

    @staticmethod
    def usable(tensors: Iterable[torch.Tensor]) -> bool:
        """A GPU is present and every given static input lives on one."""
        if not torch.cuda.is_available():
            return False
        return all(t.device.type == "cuda" for t in tensors)

    def _side_stream(self) -> "torch.cuda.Stream":
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def warmup(self, fn: Callable[[], Any]) -> Any:
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def capture(self, fn: Callable[[], Any]) -> Any:
        stream = self._side_stream()
        graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph synchronizes the device before capturing, so work queued
        # on the caller's stream is complete and no explicit wait is needed here.
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            outputs = fn()
        self._graph = graph
        self._outputs = outputs
        # The capture recorded the kernels without running them: run them once now.
        graph.replay()
        return outputs

    def replay(self) -> Any:
        assert self._graph is not None, "replay() before capture()"
        self._graph.replay()
        return self._outputs

    def reset(self) -> None:
        if self._graph is not None:
            # Let queued replays finish before the graph's memory can be reused.
            torch.cuda.current_stream().synchronize()
            self._graph.reset()
        self._graph = None
        self._outputs = None

    def close(self) -> None:
        self.reset()
        self._stream = None
        self._pool = None
