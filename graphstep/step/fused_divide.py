"""A conditional in-place division of grads by a device scalar, at no cost when a device flag says no.

torch's fused SGD is the one torch op that takes a device flag (``found_inf``) and, when it is set, returns
without touching memory (on the CPU before its loop, on a GPU in each block); when it is not set, with lr 0 it
divides its grads in place by ``grad_scale`` (its unscale) and writes its "params" as 0 +- 0. Called over
chunks of one scratch as the params, it is a division that a step can leave in its graph for every step and
that costs a call, no pass over the grads, where the flag is set: the update's pre-division
(stages/grad_prescale.py) and the norm's prescale (norm_prescale.py).
"""

from __future__ import annotations

import torch

CHUNK = 1 << 20  # elements per scratch chunk: 4 MiB of fp32 scratch at most


def chunks_of(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """``pieces`` cut into views of at most ``CHUNK`` elements (what one scratch chunk covers)."""
    return [piece[start:start + CHUNK] for piece in pieces for start in range(0, piece.numel(), CHUNK)]


def divide_unless(chunks: list[torch.Tensor], scratch_chunks: list[torch.Tensor], divisor: torch.Tensor,
                  off: torch.Tensor) -> None:
    """``chunks /= divisor`` in place, unless ``off`` is 1.0: then nothing is read or written (module docstring).
    ``scratch_chunks``: one per chunk, as long and of its dtype, written as 0 +- 0 and never read."""
    torch._fused_sgd_(scratch_chunks, chunks, [], weight_decay=0.0, momentum=0.0, lr=0.0, dampening=0.0,
                      nesterov=False, maximize=False, is_first_step=False, grad_scale=divisor, found_inf=off)
