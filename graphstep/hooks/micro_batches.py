"""The engine's one grad-accumulation switch, ``opt.no_sync()``, read by every hook that acts on a grad's
last backward: the overlapped reduce-scatter launch (graphstep/hooks/grad_overlap.py) and the folded norm
(graphstep/step/folded_sums.py)."""

from __future__ import annotations

import contextlib
from typing import Iterator


class NoSync:
    """``active`` is True inside ``no_sync()``: a backward there is an earlier micro-batch, which only
    accumulates; the hooks act in the last micro-batch's backward, outside it."""

    def __init__(self):
        self.active = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        previous, self.active = self.active, True
        try:
            yield
        finally:
            self.active = previous
