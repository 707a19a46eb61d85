"""Names in a message to the user: the first few, and how many more, so a model of thousands of params gives a
readable line."""

from __future__ import annotations

from typing import Iterable


def listed(names: Iterable[str], most: int = 8) -> str:
    """``"a, b, c and 4 more"``: the first ``most`` of ``names``, joined, then the count of the rest."""
    names = list(names)
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"
