"""The interface every backend implements; the Graph object only talks to this."""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Protocol, runtime_checkable


@runtime_checkable
class Backend(Protocol):
    """One captured step's machinery. A backend instance owns its graph, pool, stream.

    warmup(fn)  run fn eagerly (where a capture would later run it), return its result
    capture(fn) capture fn AND apply its effects exactly once; return fn's outputs,
                which become graph-owned (every replay updates them in place)
    replay()    apply the captured step once more; return the same output objects
    reset()     drop the captured step (a later capture starts afresh)
    close()     reset and release everything (streams, pools)
    """

    name: ClassVar[str]

    def warmup(self, fn: Callable[[], Any]) -> Any: ...

    def capture(self, fn: Callable[[], Any]) -> Any: ...

    def replay(self) -> Any: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...
