"""The eager backend: no capture at all, fn runs on every call. The debugger's path."""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

from .base import CaptureOptions


class EagerBackend:
    name: ClassVar[str] = "eager"
    capture_runs_ops: ClassVar[bool] = True

    def __init__(self, *, pool: Any = None, label: str = "step", options: Optional[CaptureOptions] = None) -> None:
        self._fn: Optional[Callable[[], Any]] = None

    @staticmethod
    def usable(tensors) -> bool:
        return True

    def warmup(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def capture(self, fn: Callable[[], Any]) -> Any:
        self._fn = fn
        return fn()

    def replay(self) -> Any:
        assert self._fn is not None, "replay() before capture()"
        return self._fn()

    def reset(self) -> None:
        self._fn = None

    def close(self) -> None:
        self.reset()

    def pool_bytes(self) -> Optional[int]:
        return None  # no capture, no pool
