"""The factor the update divides loss-scaled grads by, split so that no part of it overflows fp32.

The update divides the grads by ``grad_scale = loss scale / clip coefficient``, one fp32 number, which overflows
under a loss scale near 2**127 with a small clip coefficient (the kernels would then apply weight decay alone),
and loses bits where its inverse falls below fp32's smallest normal. So where that happens the factor is split
(in the clip stage's scalar math) into a power of two ``prescale``, exact to divide by, and the rest, which the
kernel gets. The grads are divided by ``prescale`` in place by torch's fused SGD with lr 0 over a scratch: the
one torch op that takes a device flag and, when set, returns without touching memory, so an ordinary step pays
a call and no pass over the grads, with no host read.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..fused_divide import chunks_of, divide_unless

FLOAT32_TINY = 2.0 ** -126  # fp32's smallest normal number
KERNEL_EXPONENT = 125  # the kernel's part of a split factor lies in [2**(this - 1), 2**(this + 1)]
MAX_PRESCALE_EXPONENT = 127


def split_math(kernel_scale, prescale, untouched, grad_scale, inv_loss_scale, clip_coef, found_inf) -> None:
    """The split (module docstring), written into its first three tensors; the clip stage runs it in its scalar
    graph, right after the grad scale, when the grads come loss-scaled."""
    # grad_scale is 1 / this product (the clip stage's fp32 arithmetic); it is exact and finite when the
    # product is a normal fp32 number.
    representable = inv_loss_scale * clip_coef >= FLOAT32_TINY
    log_factor = -(torch.log2(inv_loss_scale) + torch.log2(clip_coef))  # +inf for a coefficient of 0
    excess = torch.nan_to_num(torch.ceil(log_factor) - KERNEL_EXPONENT, nan=0.0)
    excess = excess.clamp(0, MAX_PRESCALE_EXPONENT).to(torch.int32)
    # 2**excess from its exponent bits: exact, whatever the device's exp2 rounds.
    power = torch.bitwise_left_shift(excess + 127, 23).view(torch.float32)
    rest = torch.reciprocal(inv_loss_scale * power * clip_coef)
    torch.where(representable, grad_scale, rest, out=kernel_scale)
    torch.where(representable, torch.ones_like(power), power, out=prescale)
    torch.logical_or(representable, found_inf != 0, out=untouched)  # fused SGD's found_inf: 1.0 = return


class GradPrescale:
    """The conditional pre-division over ``pieces`` (the grads the update reads), by the split the clip stage wrote
    into the step's tensors ``t`` (``kernel_grad_scale``, ``grad_prescale``, ``grad_prescale_off``)."""

    def __init__(self, pieces: list[torch.Tensor], t, scratch_registry: dict, name: str = "grad_prescale"):
        self.t, self._name = t, name
        self.chunks = chunks_of(pieces)
        self._registry = scratch_registry
        self._scratch_chunks: Optional[list[torch.Tensor]] = None

    def _scratch(self) -> list[torch.Tensor]:
        """The fused SGD's "params": allocated on the first loss-scaled step (an engine without a loss scale never
        needs them), then kept, registered under its name (memory stats count it)."""
        if self._scratch_chunks is None:
            longest = max(chunk.numel() for chunk in self.chunks)
            scratch = {dtype: torch.zeros(longest, dtype=dtype, device=self.chunks[0].device)
                       for dtype in sorted({chunk.dtype for chunk in self.chunks}, key=str)}
            self._registry[self._name] = list(scratch.values())
            self._scratch_chunks = [scratch[chunk.dtype][:chunk.numel()] for chunk in self.chunks]
        return self._scratch_chunks

    def __call__(self) -> torch.Tensor:
        """Pre-divide the grads where the clip stage's split says so; return what the kernel divides by."""
        t = self.t
        divide_unless(self.chunks, self._scratch(), t.grad_prescale, t.grad_prescale_off)
        return t.kernel_grad_scale


def build(ctx, segments, kernel_grads, grads_in_flat) -> Optional[GradPrescale]:
    """The pre-division over the grads ``segments`` of ``kernel_grads`` cover (stages/update.py's), or None where
    the update reads no grads on this rank."""
    pieces = _merged_pieces(segments, kernel_grads, grads_in_flat)
    return GradPrescale(pieces, ctx.tensors, ctx.buffers.scratch) if pieces else None


def _merged_pieces(segments, kernel_grads, grads_in_flat) -> list[torch.Tensor]:
    """The grads the segments cover, adjacent ranges of one buffer merged into one view."""
    ranges: dict[int, list[list[int]]] = {}
    spans = sorted((s.buffer, s.flat_start, s.flat_end) if grads_in_flat[s.buffer] else
                   (s.buffer, s.shard_start, s.shard_end) for s in segments)
    for buffer, start, end in spans:
        runs = ranges.setdefault(buffer, [])
        if runs and runs[-1][1] == start:
            runs[-1][1] = end
        else:
            runs.append([start, end])
    return [kernel_grads[b][start:end] for b, runs in sorted(ranges.items()) for start, end in runs if end > start]
