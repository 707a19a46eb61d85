"""The norms of rows of grads, one fp32 norm per row: what the norm stage and the folded norm compute every row's
norm with (graphstep/step/stages/norm.py ``row_norms``). On the CPU, fp32 rows run graphstep's native loop
(graphstep/native/update_loops.cpp, ``graphstep_row_norms``) as one custom op, so that a captured step replays
it; elsewhere, and where the library is not built, ``torch.linalg.vector_norm``. Each way gives each row the
same bits whatever the thread count; the two ways differ in the last bits (their sums run in other orders).
"""

from __future__ import annotations

import torch

from ..native import update_loops


def row_norms(rows: torch.Tensor, out: torch.Tensor) -> None:
    """The fp32 norm of each row of ``rows`` (n, length) into ``out`` (n,)."""
    if update_loops.row_norms_cover(rows, out):
        _native_row_norms(rows, out)
    else:
        torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32, out=out)


@torch.library.custom_op("graphstep::row_norms_", mutates_args=("out",))
def _native_row_norms(rows: torch.Tensor, out: torch.Tensor) -> None:
    update_loops.row_norms(rows, out)


@_native_row_norms.register_fake
def _(rows, out) -> None:
    return None
