"""The interface every backend implements; the Graph object only talks to this."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Protocol, Union, runtime_checkable

import torch


@dataclass(frozen=True)
class CaptureOptions:
    """What a Graph tells its backend beyond the callable. Backends ignore what does not apply.

    allow_rng: the step may draw random numbers. The replay backend refuses RNG ops otherwise; a
               CUDA graph replays draws only from generators registered with it (torch registers the
               default CUDA generator itself; register others with CUDAGraph.register_generator_state).
    device:    the device the step runs on, or a zero-argument callable returning it (or None) when
               first needed; the CUDA backend creates its stream and graph under it. None: the
               current device at the first warm-up or capture.
    """

    allow_rng: bool = False
    device: Union[None, torch.device, str, Callable[[], Optional[torch.device]]] = None


@runtime_checkable
class Backend(Protocol):
    """One captured step's machinery. A backend instance owns its graph, pool, stream.

    warmup(fn)  run fn eagerly (where a capture would later run it), return its result
    capture(fn) capture fn AND apply its effects exactly once (or, if it raises, at most partly: see
                capture_runs_ops); return fn's outputs,
                which become graph-owned (every replay updates them in place)
    replay()    apply the captured step once more; return the same output objects
    reset()     drop the captured step (a later capture starts afresh)
    close()     reset and release everything (streams, pools)
    pool_bytes() bytes reserved in the captured step's private memory pool, or None where the
                backend keeps no pool (or nothing is captured)
    """

    name: ClassVar[str]
    capture_runs_ops: ClassVar[bool]
    """Whether ``capture(fn)`` runs fn's ops as it records them (so a capture that fails part-way has
    applied part of the step), or only records them (a failed capture applied nothing)."""

    def warmup(self, fn: Callable[[], Any]) -> Any: ...

    def capture(self, fn: Callable[[], Any]) -> Any: ...

    def replay(self) -> Any: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...

    def pool_bytes(self) -> Optional[int]: ...
