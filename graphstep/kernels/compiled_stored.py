"""Adam over main params and moments stored below fp32, as ``torch.compile``d passes that decode, update and encode
in registers: no fp32 copy of any state, no temporaries in memory.

The same arithmetic as the compiled update's loop, op for op, with the decoding before it and the encoding
after it, so the result is bitwise the eager fp32-window path's (graphstep/step/stages/fp32_windows.py) with
``kernel="compiled"``; each encoding (``ENCODINGS``) follows graphstep/state/precision.py's rules. A scaled kind
needs its new values' per-piece maximum before it can encode, so such a step takes two passes: per-row maxima
folded into per-piece scales, then the new values recomputed from the stored bytes (cheaper than writing and
reading them) and encoded. Views are cut as compiled.py cuts them; everything runs in one ``torch.library``
custom op per call. Grads are read, never written. On the CPU the call runs as graphstep's native loops instead
(graphstep/native/stored_loops.py, ``_native_covers``): the same passes and bytes, the scales between the two
computed by this module's own ops (``_next_scales``, ``_inverse``).
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Optional

import torch

from ..native import stored_loops, update_loops
from . import compiled
from .adam_coefficients import adam_coefficients
from .inductor_options import compile_options

LIVE_FIELDS = compiled.LIVE_FIELDS

ENCODINGS = ("f32", "bf16", "f16", "f8", "rem")
RANGES = {"f16": torch.finfo(torch.float16).max / 2, "f8": 448.0}
"""The largest stored magnitude of each scaled encoding (graphstep/state/precision.py's ``Storage.range``)."""
_MIN_SCALE = torch.finfo(torch.float32).tiny
_FP32_MAX = torch.finfo(torch.float32).max
_KINDS = ("main", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class SegmentSpec:
    """How one segment of a group is stored: an encoding per kind (``_KINDS``) and its parts' row widths."""
    main: str
    exp_avg: str
    exp_avg_sq: str
    widths: tuple[int, ...]

    def encodings(self) -> tuple[str, str, str]:
        return self.main, self.exp_avg, self.exp_avg_sq

    @property
    def scaled(self) -> tuple[int, ...]:
        """Which of the kinds are scaled (positions in ``_KINDS``)."""
        return tuple(k for k, code in enumerate(self.encodings()) if code in RANGES)

    def text(self) -> str:
        return ",".join(self.encodings()) + ":" + ",".join(map(str, self.widths))


def parse(spec: str) -> tuple[SegmentSpec, ...]:
    """``SegmentSpec.text`` of each segment, joined by ";", back into specs."""
    return _parse(spec)


@functools.cache
def _parse(spec: str) -> tuple[SegmentSpec, ...]:
    segments = []
    for text in spec.split(";"):
        codes, widths = text.split(":")
        main, exp_avg, exp_avg_sq = codes.split(",")
        if main not in ("f32", "f16", "rem") or {exp_avg, exp_avg_sq} - {"f32", "bf16", "f16", "f8"}:
            raise ValueError(f"compiled_stored: no encoding {codes!r}: main params f32 / f16 / rem, moments "
                             "f32 / bf16 / f16 / f8")
        segments.append(SegmentSpec(main, exp_avg, exp_avg_sq, tuple(int(w) for w in widths.split(","))))
    return tuple(segments)


def _tensor_count(code: str) -> int:
    return 2 if code == "rem" else 1  # the remainder: the bf16 params' bits (int16) and the low halves


def _unpack(segments, written, read):
    """The op's flat lists as, per segment: per part (per kind its tensors, grad, row index or None), and per kind
    its scales (None where unscaled). The order is ``pack``'s."""
    w, r, unpacked = iter(written), iter(read), []
    for segment in segments:
        parts = []
        for _ in segment.widths:
            stored = tuple(tuple(next(w) for _ in range(_tensor_count(code))) for code in segment.encodings())
            parts.append([stored, next(r), None])
        scales = tuple(next(w) if code in RANGES else None for code in segment.encodings())
        if segment.scaled:
            for part in parts:
                part[2] = (next(r), next(r), next(r))  # each row's first piece, second piece, column of the second
        unpacked.append((parts, scales))
    return unpacked


def pack(parts: list, scales: tuple, rows: Optional[list]) -> tuple[list, list]:
    """One segment's (written, read) tensors in the op's order: ``parts`` as [(per kind its tensors, grad)],
    ``scales`` per kind (or None), ``rows`` per part (first, second, split) where a kind is scaled."""
    written = [t for stored, _ in parts for tensors in stored for t in tensors]
    written += [s for s in scales if s is not None]
    read = [grad for _, grad in parts]
    read += [t for index in rows or () for t in index]
    return written, read


# ---- the arithmetic, traced by dynamo -------------------------------------------------------------------------

def _sides(index, width: int, device):
    """Per element of a (rows, ``width``) part: whether it lies right of its row's split (its second piece)."""
    _, _, split = index  # fp32: a float comparison vectorises where an int64 one takes four vectors a lane group
    return torch.arange(width, device=device, dtype=torch.float32).unsqueeze(0) >= split.unsqueeze(1)


def _spread(per_piece: torch.Tensor, index, right: torch.Tensor) -> torch.Tensor:
    first, second, _ = index
    return torch.where(right, per_piece[second].unsqueeze(1), per_piece[first].unsqueeze(1))


def _decode(code: str, tensors: tuple, scale: Optional[torch.Tensor], fp8_values) -> torch.Tensor:
    """The fp32 values of one kind's stored part (``scale``: per element, for a scaled kind; ``fp8_values``:
    ``_fp8_values``)."""
    if code == "f32":
        return tensors[0]
    if code == "rem":  # precision.RemainderMain.read, in int64 as there
        high_bits, low_bits = tensors
        low = low_bits.to(torch.int64) & 0xFFFF
        high = (high_bits.to(torch.int64) - (low >> 15)) & 0xFFFF
        bits = (high << 16) | low
        return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)
    if code == "f8":  # stored as bytes, read through a table (faster here than the cast and a NaN test per lane)
        return fp8_values[tensors[0].to(torch.int64)] * scale
    values = tensors[0].to(torch.float32)
    return values if code == "bf16" else values * scale


def _magnitudes(code: str, values: torch.Tensor) -> torch.Tensor:
    """``StoredState.write``'s magnitudes: NaN counts 0, inf the least magnitude that makes the scale nonzero."""
    # As comparisons, which vectorise (inductor's nan_to_num tests each lane for NaN in a scalar loop).
    magnitudes = values.abs()
    magnitudes = torch.where(magnitudes > _FP32_MAX, _MIN_SCALE * RANGES[code], magnitudes)
    return torch.where(magnitudes != magnitudes, 0.0, magnitudes)


def _encode(code: str, tensors: tuple, values: torch.Tensor, inverse: Optional[torch.Tensor]) -> None:
    """Store fp32 ``values`` into one kind's part (``inverse``: per element, 1 / the new scale)."""
    if code == "f32":
        tensors[0].copy_(values)
    elif code == "bf16":
        tensors[0].copy_(values.to(torch.bfloat16))
    elif code == "rem":  # precision.RemainderMain.write
        high_bits, low_bits = tensors
        bits = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        low = bits & 0xFFFF
        high = ((bits >> 16) + (low >> 15)) & 0xFFFF
        high_bits.copy_(_as_int16(high))
        low_bits.copy_(_as_int16(low))
    elif code == "f16":
        tensors[0].copy_((values * inverse).to(torch.float16))
    else:  # f8: the cast gives ±448 for ±inf; the NaN bytes of that sign are one bit above
        infinite = torch.gt(values.abs(), _FP32_MAX).to(torch.uint8)
        stored = (values * inverse).to(torch.float8_e4m3fn).view(torch.uint8)
        tensors[0].copy_(torch.bitwise_or(stored, infinite))


def _as_int16(unsigned: torch.Tensor) -> torch.Tensor:
    return (unsigned - ((unsigned >> 15) << 16)).to(torch.int16)


def _new_values(segment: SegmentSpec, part, scales, c: torch.Tensor, width: int, fp8_values) -> tuple:
    """One part's (new main params, exp_avg, exp_avg_sq) in fp32, the skip selected: ``compiled.adam_values``
    on the decoded values. Also the part's right-of-split mask (None without a scaled kind)."""
    stored, grad, index = part
    right = None if index is None else _sides(index, width, grad.device)
    param, exp_avg, exp_avg_sq = (
        _decode(code, tensors, None if scale is None else _spread(scale, index, right), fp8_values)
        for code, tensors, scale in zip(segment.encodings(), stored, scales))
    return compiled.adam_values(param, grad, exp_avg, exp_avg_sq, c), right


def _coefficients(hypers, step, grad_scale, found_inf, decoupled: bool) -> torch.Tensor:
    return adam_coefficients(hypers, step, grad_scale, found_inf, decoupled).to(torch.float32)[0]


def _new_scales(segments: tuple, written: list, read: list, hypers, step, grad_scale, found_inf, decoupled: bool):
    """The first pass: per segment and scaled kind, the pieces' new scales (the old ones on a skipped step)."""
    c = _coefficients(hypers, step, grad_scale, found_inf, decoupled)
    keep = found_inf == 0
    out = []
    for segment, (parts, scales) in zip(segments, _unpack(segments, written, read)):
        amax = [None if s is None else torch.zeros_like(s) for s in scales]
        for width, part in zip(segment.widths, parts):
            new, right = _new_values(segment, part, scales, c, width, read[-1])
            first, second, _ = part[2]
            for k in segment.scaled:
                magnitudes = _magnitudes(segment.encodings()[k], new[k])
                left_max = torch.where(right, 0.0, magnitudes).amax(1)
                right_max = torch.where(right, magnitudes, 0.0).amax(1)
                amax[k] = amax[k].scatter_reduce(0, first, left_max, "amax").scatter_reduce(0, second, right_max,
                                                                                            "amax")
        out += [_next_scales(amax[k], segment.encodings()[k], keep, scales[k]) for k in segment.scaled]
    return out


def _next_scales(amax: torch.Tensor, code: str, keep: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per piece, the scale a kind is stored with next, from its new values' largest magnitudes (``amax``): the
    old ``scales`` on a skipped step."""
    new_scales = amax / RANGES[code]
    new_scales = torch.where(new_scales > 0, new_scales.clamp(min=_MIN_SCALE), new_scales)
    return torch.where(keep, new_scales, scales)


def _inverse(scales: torch.Tensor) -> torch.Tensor:
    return 1.0 / scales.clamp(min=_MIN_SCALE)


def _store(segments: tuple, written: list, read: list, new_scales: list, hypers, step, grad_scale, found_inf,
           decoupled: bool) -> None:
    """The last pass: the new values, encoded with the new scales (``_new_scales``'), which it then stores."""
    c = _coefficients(hypers, step, grad_scale, found_inf, decoupled)
    fresh = iter(new_scales)
    for segment, (parts, scales) in zip(segments, _unpack(segments, written, read)):
        segment_scales = [next(fresh) if k in segment.scaled else None for k in range(len(_KINDS))]
        inverses = [None if s is None else _inverse(s) for s in segment_scales]
        for width, part in zip(segment.widths, parts):
            new, right = _new_values(segment, part, scales, c, width, read[-1])
            for k, code in enumerate(segment.encodings()):
                inverse = None if inverses[k] is None else _spread(inverses[k], part[2], right)
                _encode(code, part[0][k], new[k], inverse)
        for k in segment.scaled:
            scales[k].copy_(segment_scales[k])


# ---- compiling and calling ------------------------------------------------------------------------------------

@functools.cache
def _compiled(pass_fn, spec: str, decoupled: bool, scaled_grad: bool, device_type: str):
    """``pass_fn`` compiled for one layout ``spec``, bound to its parsed segments, under a code object of its own:
    dynamo's compiled variants and its recompile limit are per code object (as in graphstep/kernels/compiled.py)."""
    bound = _bind(pass_fn, parse(spec))
    name = f"{pass_fn.__name__}_{len(_compiled_names)}_{int(decoupled)}{int(scaled_grad)}"
    _compiled_names.append(name)
    fn = types.FunctionType(bound.__code__.replace(co_name=name), bound.__globals__, name, None, bound.__closure__)
    return torch.compile(fn, fullgraph=True, dynamic=False, options={**compile_options(device_type), **_INLINE})


# Inductor writes a value out to memory (an fp32 temporary) once it has more readers or ops than these
# thresholds; the decoded state has many of both, and a temporary is what this kernel exists to avoid: every
# value is recomputed where it is read.
_INLINE = {name: 10**6 for name in ("realize_reads_threshold", "realize_opcount_threshold",
                                    "realize_cpu_opcount_threshold", "realize_acc_reads_threshold",
                                    "realize_cpu_acc_reads_threshold")}
_compiled_names: list = []


def _bind(pass_fn, segments: tuple):
    def bound(*args):
        return pass_fn(segments, *args)
    return bound


def _mark_dynamic(tensors: list) -> None:
    # Row counts and piece counts vary with the layout: dynamic, so one compile serves every length (a size of
    # 0 or 1 stays static: dynamo specializes those).
    for t in tensors:
        if t.shape[0] > 1:
            torch._dynamo.mark_dynamic(t, 0)


@functools.cache
def _fp8_values(device: torch.device) -> torch.Tensor:
    """The fp32 value of each E4M3 byte, as graphstep/state/precision.py reads it: the cast, with the NaN encodings
    read as inf of their sign."""
    stored = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    values = stored.view(torch.float8_e4m3fn).to(torch.float32)
    values = torch.where(torch.isnan(values), torch.where(stored >= 128, -torch.inf, torch.inf), values)
    return values.to(device)


@torch.library.custom_op("graphstep::compiled_stored_adam_", mutates_args=("written",))
def _stored_adam_op(written: list[torch.Tensor], read: list[torch.Tensor], spec: str, hypers: torch.Tensor,
                    step: torch.Tensor, grad_scale: Optional[torch.Tensor], found_inf: torch.Tensor,
                    decoupled: bool) -> None:
    segments = parse(spec)
    unpacked = _unpack(segments, written, read)
    if _native_covers(segments, unpacked):
        c = _coefficients(hypers, step, grad_scale, found_inf, decoupled)  # eager ops: the compiled graph's bits
        for segment, (parts, scales) in zip(segments, unpacked):
            if segment.scaled:
                _native_scaled(segment, parts, scales, c, found_inf == 0)
            else:
                for stored, grad, _ in parts:
                    stored_loops.adam_stored(segment.encodings(), stored, grad, c)
        return
    _mark_dynamic(written)
    _mark_dynamic(read)
    read = read + [_fp8_values(read[0].device)]  # last: the passes read it there
    device_type = read[0].device.type
    flags = (decoupled, grad_scale is not None)
    variant = (spec, flags, tuple((t.dtype, t.device, t.shape[0] == 1) for t in (*written, *read)))
    new_scales = []
    if any(segment.scaled for segment in parse(spec)):
        new_scales = _call(_compiled(_new_scales, spec, *flags, device_type), ("scales",) + variant,
                           written, read, hypers, step, grad_scale, found_inf, decoupled)
    _call(_compiled(_store, spec, *flags, device_type), ("store",) + variant,
          written, read, new_scales, hypers, step, grad_scale, found_inf, decoupled)


def _native_covers(segments: tuple, unpacked: list) -> bool:
    """Whether the native loops (graphstep/native/stored_loops.py) run this call: every part's encodings and
    tensors ones they take, and their library built. Bitwise the same as the compiled passes."""
    def covered(segment, parts, scales) -> bool:
        if segment.scaled:
            return all(stored_loops.scaled_covers(segment.encodings(), stored, grad, index, scales)
                       for stored, grad, index in parts)
        return all(stored_loops.stored_covers(segment.encodings(), stored, grad) for stored, grad, _ in parts)

    return (all(covered(segment, parts, scales) for segment, (parts, scales) in zip(segments, unpacked))
            and update_loops.stored_library() is not None)


def _native_scaled(segment: SegmentSpec, parts: list, scales: tuple, c: torch.Tensor, keep: torch.Tensor) -> None:
    """A segment with a scaled kind, in the native loop's two passes (``_new_scales``, then ``_store``); the
    per-piece scales between them by the same ops."""
    codes, fp8_values = segment.encodings(), _fp8_values(torch.device("cpu"))
    infinite = tuple(_MIN_SCALE * RANGES[code] if code in RANGES else 0.0 for code in codes)
    amax = tuple(None if s is None else torch.zeros_like(s) for s in scales)
    for stored, grad, index in parts:
        stored_loops.adam_scaled(1, codes, stored, grad, index, scales, amax, fp8_values, infinite, c)
    new_scales = [None if s is None else _next_scales(a, code, keep, s) for a, code, s in zip(amax, codes, scales)]
    inverses = tuple(None if s is None else _inverse(s) for s in new_scales)
    for stored, grad, index in parts:
        stored_loops.adam_scaled(2, codes, stored, grad, index, scales, inverses, fp8_values, infinite, c)
    for old, new in zip(scales, new_scales):
        if old is not None:
            old.copy_(new)


@_stored_adam_op.register_fake
def _(written, read, spec, hypers, step, grad_scale, found_inf, decoupled) -> None:
    return None


def _call(fn, variant, *args):
    result = []
    compiled.call_compiled(lambda *a: result.append(fn(*a)), *args, variant=variant)
    return result[0]


def adam_stored(written: list, read: list, spec: str, hyper: dict, *, step, decoupled: bool, grad_scale,
                found_inf) -> None:
    """One group's Adam over its segments (``pack``'s lists, described by ``spec``), every hyperparameter in
    ``hyper`` (lr, beta1, beta2, weight_decay, eps) a 0-d device tensor or a float."""
    _stored_adam_op(written, read, spec, compiled._hyper_table([hyper], read[0].device), step, grad_scale,
                    found_inf, decoupled)
