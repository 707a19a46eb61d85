"""Optimizer state and main params stored below fp32 (``use_precision_aware_optimizer``): how each storage
holds fp32 values, read and written a range of whole pieces at a time.

The rules are Transformer Engine FusedAdam's, which Megatron-Core's precision-aware optimizer runs: bf16 a plain
cast; fp16 and fp8 (E4M3) one fp32 scale per piece, ``scale = amax / range``, recomputed after every update;
``RemainderMain`` for fp32 main params of bf16 params. Where TE would store NaN these keep what fp32 state would
hold: a moment that overflowed stays inf (the scale comes from the largest finite magnitude), and a scale never
drops below ``MIN_SCALE``, the smallest normal fp32, so its inverse stays finite. A piece is one param's elements
in this rank's shard, what Megatron-Core hands TE as a param. A skipped step leaves every stored byte and scale
as it was: ``cast(stored * scale / scale)`` is ``stored`` again.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

CHUNK_NUMEL = 1 << 22
"""Elements the update decodes at once (whole pieces; a larger piece alone): 16 MiB of fp32 per state."""


_FP32_MAX = torch.finfo(torch.float32).max
MIN_SCALE = torch.finfo(torch.float32).tiny
"""The least nonzero scale (2^-126): smaller ones are subnormal, and their inverse overflows to inf."""


@dataclass(frozen=True)
class Storage:
    dtype: torch.dtype  # what the state tensor holds
    range: Optional[float]  # the largest stored magnitude of a scaled dtype; None: stored unscaled
    remainder: bool = False  # fp32 main params as the bf16 params' bits plus this int16 low half
    inf_as_nan: bool = False
    """The dtype has no inf (E4M3): ±inf is stored as its NaN encoding of that sign, read back as ±inf."""

    @property
    def scaled(self) -> bool:
        return self.range is not None


_FP8 = Storage(torch.float8_e4m3fn, 448.0, inf_as_nan=True)
STORAGE = {
    torch.float32: Storage(torch.float32, None),
    torch.bfloat16: Storage(torch.bfloat16, None),
    torch.float16: Storage(torch.float16, torch.finfo(torch.float16).max / 2),
    torch.uint8: _FP8,  # Megatron-Core's spelling of fp8 (--exp-avg-dtype fp8)
    torch.float8_e4m3fn: _FP8,
}


def state_storage(config, name: str) -> Storage:
    """How state ``name`` is stored under ``config``: below fp32 only with the precision-aware optimizer."""
    dtypes = {"exp_avg": config.exp_avg_dtype, "exp_avg_sq": config.exp_avg_sq_dtype}
    if not config.use_precision_aware_optimizer or name not in dtypes:
        return Storage(main_compute_dtype(config), None)
    return STORAGE[dtypes[name]]


REMAINDER = Storage(torch.int16, None, remainder=True)
_HALF = (torch.bfloat16, torch.float16)


def storage_by_state(config, names) -> dict[str, Storage]:
    """``state_storage`` of every state in ``names`` (what ``allocate`` takes)."""
    return {name: state_storage(config, name) for name in names}


def main_storage(config) -> dict[torch.dtype, Storage]:
    """Per param dtype, how the main params of a buffer of such params are stored, where not in
    ``main_compute_dtype``: bf16 params with ``store_param_remainders`` keep the fp32 main params' low 16
    bits (``RemainderMain``); half params with ``main_params_dtype=float16`` keep them in fp16, scaled per
    piece as TE's FusedAdam does its fp16 master weights (range 32752)."""
    if not config.use_precision_aware_optimizer:
        return {}
    if config.main_params_dtype == torch.float16:
        return {dtype: STORAGE[torch.float16] for dtype in _HALF}
    if config.store_param_remainders and config.main_params_dtype == torch.float32:
        return {torch.bfloat16: REMAINDER}
    return {}


def main_compute_dtype(config) -> torch.dtype:
    """The dtype the update computes the main params in: fp32 where they are stored in fp16."""
    return torch.float32 if config.main_params_dtype == torch.float16 else config.main_params_dtype


class StoredState:
    """One state buffer stored below fp32: its data, its pieces (contiguous runs that share a scale) and,
    for a scaled dtype, one fp32 scale per piece. Coordinates are the state buffer's own."""

    def __init__(self, storage: Storage, data: torch.Tensor, piece_starts: Sequence[int]):
        self.storage = storage
        self.data = data
        self.starts = list(piece_starts) + [data.numel()]  # piece i is [starts[i], starts[i + 1])
        lengths = [b - a for a, b in zip(self.starts, self.starts[1:])]
        if (lengths and self.starts[0] != 0) or any(n <= 0 for n in lengths):
            raise ValueError(f"StoredState: pieces must tile [0, {data.numel()}) without empty ones")
        self.lengths = lengths
        self.positions = torch.tensor(self.starts[:-1], dtype=torch.int64, device=data.device)
        self.scales = torch.zeros(len(lengths), dtype=torch.float32, device=data.device) if storage.scaled else None

    def pieces(self, start: int, end: int) -> tuple[int, int]:
        """The pieces [i, j) that make up [start, end), which must begin and end at piece boundaries."""
        i, j = bisect.bisect_left(self.starts, start), bisect.bisect_left(self.starts, end)
        if self.starts[i] != start or self.starts[j] != end:
            raise ValueError(f"StoredState: [{start}, {end}) does not begin and end at piece boundaries")
        return i, j

    def piece_index(self, start: int, end: int) -> torch.Tensor:
        """For each element of [start, end) (whole pieces i..j-1), its piece's number counted from i: what
        spreads one value per piece over the elements. Counted on device (a mark at each piece start, summed
        up), so nothing is read on the host and the only per-element temporaries are this range's. Every
        stored kind of a buffer has the same pieces, so one index serves them all."""
        i, j = self.pieces(start, end)
        marks = torch.zeros(end - start, dtype=torch.int32, device=self.data.device)
        marks.index_fill_(0, self.positions[i + 1:j] - start, 1)
        return marks.cumsum(0, dtype=torch.int32)

    def read(self, start: int, end: int, out: Optional[torch.Tensor] = None,
             index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The fp32 values of [start, end) (into ``out`` when given; ``index``: ``piece_index(start, end)``)."""
        out = torch.empty(end - start, dtype=torch.float32, device=self.data.device) if out is None else out
        out.copy_(self.data[start:end])
        if self.storage.inf_as_nan:  # NaN -> inf, then the sign of the NaN (two fast passes; torch.where is slow)
            torch.copysign(out.nan_to_num(nan=math.inf, posinf=math.inf, neginf=-math.inf), out, out=out)
        if self.storage.scaled:
            i, j = self.pieces(start, end)
            index = self.piece_index(start, end) if index is None else index
            out.mul_(self.scales[i:j].index_select(0, index))  # a piece holding inf has a scale > 0: inf again
        return out

    def write(self, start: int, end: int, values: torch.Tensor, keep: Optional[torch.Tensor] = None,
              index: Optional[torch.Tensor] = None) -> None:
        """Store fp32 ``values`` as [start, end), each piece's scale from its new amax; ``keep`` (0-d bool):
        where False, the old scales stay (a skipped step, whose values are the stored ones)."""
        if not self.storage.scaled:
            self.data[start:end].copy_(values)
            return
        i, j = self.pieces(start, end)
        # The scale comes from the finite magnitudes: an inf counts as the least one that makes the scale nonzero,
        # so that inf is stored (and read back, inf * scale) as inf.
        magnitudes = values.abs()
        infinite = torch.gt(magnitudes, _FP32_MAX) if self.storage.inf_as_nan else None  # faster than isinf
        magnitudes.nan_to_num_(nan=0.0, posinf=MIN_SCALE * self.storage.range)
        # One multi-tensor max over the pieces (torch's segment_reduce is slower on the CPU).
        amax = torch.stack(torch._foreach_max(torch.split(magnitudes, self.lengths[i:j])))
        scales = amax / self.storage.range
        scales = torch.where(scales > 0, scales.clamp(min=MIN_SCALE), scales)  # 0: an all-zero piece, as TE's
        if keep is not None:
            scales = torch.where(keep, scales, self.scales[i:j])
        self.scales[i:j].copy_(scales)
        inverse = 1.0 / scales.clamp(min=MIN_SCALE)  # finite; an all-zero piece's values stay 0 times it
        index = self.piece_index(start, end) if index is None else index
        scaled = values * inverse.index_select(0, index)
        # Finite values lie past the range by an fp32 rounding at most, which each cast rounds back onto it (float16's
        # range is half its largest value; E4M3 rounds all below 464 to at most 448): no clamp, which would make inf
        # finite.
        stored = self.data[start:end]
        stored.copy_(scaled)
        if infinite is not None:  # the cast gave ±448 (0x7E / 0xFE) or NaN for ±inf: the NaN bytes 0x7F / 0xFF
            stored_bytes = stored.view(torch.uint8)
            torch.bitwise_or(stored_bytes, infinite.view(torch.uint8), out=stored_bytes)


class RemainderMain(StoredState):
    """fp32 main params kept as two halves: the bf16 param holds the high 16 bits, rounded, and ``data``
    (int16) the low 16, exactly. TE's rule (transformer_engine/common/multi_tensor/adam.cu,
    ``AdamFunctorMasterParamRemainder``): the high half is rounded up (its bit pattern incremented) where the
    low half's top bit is set, which makes the bf16 param the fp32 value rounded to nearest (ties away from
    zero); reading undoes that increment. The round trip is exact, so no fp32 copy is kept.

    ``high(start, end)``: the bf16 params of main params [start, end) (this rank's shard of them in
    ``param_flat``), which ``write`` rewrites."""

    def __init__(self, data: torch.Tensor, piece_starts: Sequence[int], high):
        super().__init__(REMAINDER, data, piece_starts)
        self.high = high

    def read(self, start: int, end: int, out: Optional[torch.Tensor] = None,
             index: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = torch.empty(end - start, dtype=torch.float32, device=self.data.device) if out is None else out
        low = self.data[start:end].to(torch.int64) & 0xFFFF
        high = (self.high(start, end).view(torch.int16).to(torch.int64) - (low >> 15)) & 0xFFFF
        bits = (high << 16) | low  # the fp32 bit pattern, unsigned, in int64: no overflow
        out.copy_((bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32))
        return out

    def write(self, start: int, end: int, values: torch.Tensor, keep: Optional[torch.Tensor] = None,
              index: Optional[torch.Tensor] = None) -> None:
        # ``keep`` and ``index`` are not needed: a skipped step hands back the values read, whose halves are the
        # stored ones.
        bits = values.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        low = bits & 0xFFFF
        high = ((bits >> 16) + (low >> 15)) & 0xFFFF
        self.high(start, end).view(torch.int16).copy_(_as_int16(high))
        self.data[start:end].copy_(_as_int16(low))


def _as_int16(unsigned: torch.Tensor) -> torch.Tensor:
    """16-bit patterns held as 0..65535 (int64) as the int16 values with those bits."""
    return (unsigned - ((unsigned >> 15) << 16)).to(torch.int16)


def chunks(state: StoredState, start: int, end: int) -> list[tuple[int, int]]:
    """[start, end) (whole pieces) cut into runs of whole pieces of at most ``CHUNK_NUMEL`` elements, a larger
    piece alone."""
    i, j = state.pieces(start, end)
    runs, run_start = [], start
    for k in range(i + 1, j + 1):
        if state.starts[k] - run_start > CHUNK_NUMEL and state.starts[k - 1] > run_start:
            runs.append((run_start, state.starts[k - 1]))
            run_start = state.starts[k - 1]
    runs.append((run_start, end))
    return runs
