"""A method of a torch class replaced while at least one recording needs it (there is no per-object hook).

Several recordings may overlap (threads, a capture inside a capture's warm-up): the first to enter installs the
wrapper, the last to leave restores the original. The wrapper itself must act only for the threads that asked
(thread-local state in the caller), since the class is shared by every thread.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator


class SharedPatch:
    """``cls.name`` replaced by ``wrap(original)`` while any caller is inside ``active()``."""

    def __init__(self, name: str, wrap: Callable[[Callable], Callable]) -> None:
        self._name, self._wrap = name, wrap
        self._lock = threading.Lock()
        self._users = 0
        self._cls = None
        self._original = None

    @contextlib.contextmanager
    def active(self, cls: type) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._cls, self._original = cls, getattr(cls, self._name)
                setattr(cls, self._name, self._wrap(self._original))
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    setattr(self._cls, self._name, self._original)
                    self._cls = self._original = None
