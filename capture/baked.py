"""Host values a captured step baked in, guarded: a change is noticed before the next replay.

A CUDA graph (and the replay backend) keeps every Python number the step used as a constant. Whoever
owns the step lists those values (``(where, name, value)`` tuples, e.g. ``("group 0", "beta2", 0.95)``)
through a zero-argument callable; ``BakedValues`` records them at capture and, before each replay,
``change()`` says what differs. The owner decides what follows (recapture, or raise): a changed value
must never be silently replayed as the old one.
"""
from __future__ import annotations

from typing import Callable, Optional

__all__ = ["BakedValues"]


class BakedValues:
    def __init__(self, values: Callable[[], tuple]):
        self._values = values
        self._recorded: Optional[tuple] = None

    def record(self) -> None:
        """Remember the values as they are now (call right after a capture)."""
        self._recorded = tuple(self._values())

    def clear(self) -> None:
        self._recorded = None

    def change(self) -> Optional[str]:
        """None when nothing changed since ``record`` (or nothing is recorded); else the first change in
        words, e.g. "group 0 weight_decay 0.1 -> 0.2"."""
        if self._recorded is None:
            return None
        now = tuple(self._values())
        if now == self._recorded:
            return None
        for before, after in zip(self._recorded, now):
            if before != after:
                where, name, old = before
                return f"{where} {name} {old!r} -> {after[2]!r}"
        return f"the baked values ({len(self._recorded)} -> {len(now)} entries)"
