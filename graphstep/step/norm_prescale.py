"""The power of two the grads are divided by around their norm's fp32 row sums, so that no loss scale the config
accepts ([2**-126, 2**127]) overflows or underflows the grad norm.

The norm is taken of the still loss-scaled grads, whose fp32 row sums of squares overflow or lose bits at
extreme scales. So outside [2**LOW_EXPONENT, 2**HIGH_EXPONENT] each row norm is taken of the grads divided in
place by ``prescale`` (the scale rounded up to a power of two) and multiplied back after: powers of two are exact,
so the grads come back bit for bit and the norm is that of the unscaled grads. Inside the band the division is
torch's fused SGD returning on its flag (graphstep/step/fused_divide.py): no pass over the grads. The row is looked
up on the device from 1 / scale's exponent bits: no host read. fp16 grads are never divided (their squares fit
fp32). The prescale must not change between a backward's folds and its step: with torch's GradScaler, which gives
its scale only at the step, a step whose scale lies more than 2**GUARD_EXPONENT from the one backward used is
skipped (graphstep/step/torch_amp.py).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from .fused_divide import CHUNK, chunks_of, divide_unless

LOW_EXPONENT = -16  # loss scales of 2**-16 to 2**40 are normed as they come
HIGH_EXPONENT = 40
MAX_EXPONENT = 126  # 2**-126 and 2**126 are both normal fp32 numbers: restore is exact
GUARD_EXPONENT = 48
RESCUE_EXPONENT = 64  # stages/norm.py's row rescue scales rows by 2**-64 (2**-126 at the least)

FIELDS = ("prescale", "restore", "off", "rescue_down", "rescue_up")
"""The prescale row (``StepTensors.norm_prescale``): the divisor, its reciprocal, fused SGD's ``found_inf`` (1.0:
nothing to divide), and the factors the row rescue scales a picked row of the grads as they are by (down) and its
fp64 norm by (up), so that it comes out as the norm of the prescaled row."""


def _row(biased_exponent: int) -> list[float]:
    """The prescale row for a loss scale whose reciprocal has ``biased_exponent`` (its fp32 exponent bits)."""
    power = max(-MAX_EXPONENT, min(MAX_EXPONENT, 127 - biased_exponent))  # the scale lies in (2**(p-1), 2**p]
    if LOW_EXPONENT <= power <= HIGH_EXPONENT:
        power = 0
    down = max(-MAX_EXPONENT, min(MAX_EXPONENT, -power - RESCUE_EXPONENT))
    return [2.0**power, 2.0**-power, float(power == 0), 2.0**down, 2.0**(-power - down)]


@functools.cache
def _table(device: torch.device) -> torch.Tensor:
    """Every prescale row, indexed by the fp32 exponent bits of 1 / loss scale: the step's lookup is two ops."""
    return torch.tensor([_row(e) for e in range(256)], dtype=torch.float32, device=device)


def prescales_at(scale: float) -> bool:
    """Whether the norm divides the grads under the loss scale ``scale`` (a host number: a constant scale)."""
    # Outside the step, on a CPU tensor made from a Python float: its fp32 bits, no device read.
    inv_bits = torch.tensor(scale, dtype=torch.float32).reciprocal().view(torch.int32).item()
    return _row(inv_bits >> 23)[2] == 0.0


def unscaled_row(device) -> torch.Tensor:
    """A fresh prescale row for no loss scale (what ``StepTensors.allocate`` starts from)."""
    return _table(torch.device(device))[127].clone()


class FromScale:
    """Writes the prescale row ``row`` for the loss scale whose reciprocal ``inv_scale`` holds (device work, two
    ops: its exponent bits index ``_table``); ``inv_scale`` is read through a view made once."""

    def __init__(self, row: torch.Tensor, inv_scale: torch.Tensor):
        self._out = row.view(1, len(FIELDS))
        self._bits = inv_scale.view(torch.int32).view(1)  # positive: no sign bit
        self._table = _table(row.device)

    def __call__(self) -> None:
        torch.index_select(self._table, 0, torch.bitwise_right_shift(self._bits, 23), out=self._out)


def far_from(prescale: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """Bool 0-d: ``prescale`` lies more than 2**GUARD_EXPONENT from the loss scale 1 / ``inv_scale``."""
    ratio = prescale * inv_scale  # an fp32 over- or underflow lies out of the bounds too
    return ratio.clamp(2.0**-GUARD_EXPONENT, 2.0**GUARD_EXPONENT) != ratio


class NormPrescale:
    """One engine's prescale (the step's tensor ``t.norm_prescale``, a row of ``FIELDS``) and the scratch its
    divisions share. ``active()``: host flag, whether a loss scale can reach the grads now (graphstep's scaler,
    or torch's GradScaler handing its scale); while it is False nothing is divided and the row is scale 1's."""

    def __init__(self, t, scratch_registry: dict, active: Callable[[], bool], longest: int):
        self.t = t
        self.active = active
        self.prescale, self.restore, self.off, self.rescue_down, self.rescue_up = t.norm_prescale.unbind(0)
        self._registry = scratch_registry
        self._longest = min(CHUNK, max(longest, 1))
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    def divider(self, grads: torch.Tensor) -> "RowDivider":
        """The conditional division of ``grads`` (a contiguous view of a grad buffer) around its row norms."""
        return RowDivider(self, chunks_of([grads.reshape(-1)]))

    def scratch_for(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Scratch "params" for ``chunks``: one shared buffer per dtype, allocated at the first division."""
        views = []
        for chunk in chunks:
            scratch = self._scratch.get(chunk.dtype)
            if scratch is None:
                scratch = torch.zeros(self._longest, dtype=chunk.dtype, device=chunk.device)
                self._scratch[chunk.dtype] = scratch
                self._registry["norm_prescale"] = list(self._scratch.values())
            views.append(scratch[:chunk.numel()])
        return views


class RowDivider:
    """Divide a view of grads by the prescale, run the row norms, multiply it back: ``around(norm)``."""

    def __init__(self, prescale: NormPrescale, chunks: list[torch.Tensor]):
        self._prescale = prescale
        self._chunks = chunks
        self._scratch: Optional[list[torch.Tensor]] = None

    def around(self, norm: Callable[[], None]) -> None:
        prescale = self._prescale
        if not self._chunks or not prescale.active():
            norm()
            return
        if self._scratch is None:
            self._scratch = prescale.scratch_for(self._chunks)
        divide_unless(self._chunks, self._scratch, prescale.prescale, prescale.off)
        norm()
        divide_unless(self._chunks, self._scratch, prescale.restore, prescale.off)
