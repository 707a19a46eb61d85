"""The update of a group with main params or moments stored below fp32 (graphstep/state/precision.py) as one
compiled call over the stored bytes (graphstep/kernels/compiled_stored.py), where the kernel is "compiled".

It replaces the chunk-by-chunk fp32 windows (fp32_windows.py), bitwise: the same arithmetic, decoded and encoded
inside the compiled loop. Built once per group: each segment's stored views, cut into a (rows, width) body and
a (n, 1) tail, and where a kind is scaled, per row the pieces on either side of the one piece boundary a row may
hold (the width is the widest power of two up to 1024 that keeps to one: the per-row work is spread over more
elements). The group's family calls it as its kernels module (``adam_groups``): only a family whose update is
Adam's can run here.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from ...kernels import compiled, compiled_stored
from ...state import precision
from . import fp32_windows

_MAX_WIDTH = 1024
_KINDS = ("main", "exp_avg", "exp_avg_sq")


def build(ctx, family, family_kernels, views, segments) -> Optional[types.SimpleNamespace]:
    """For a group whose state is stored below fp32: a kernels module (``adam_groups``, ``adam``, ``LIVE_FIELDS``)
    that updates it in one compiled call; None where the eager fp32 windows run it (a kernel other than
    "compiled", a family that is not precision-aware, main params computed in another dtype than fp32)."""
    buffers = ctx.buffers
    if family_kernels is not compiled or not family.precision_aware:
        return None
    if not any(fp32_windows.stored_in(buffers, s.buffer) for s in segments):
        return None
    if set(views.state) != {"exp_avg", "exp_avg_sq"} or len(views.params) != len(segments):
        return None
    written, read, specs = [], [], []
    for k, segment in enumerate(segments):
        packed = _segment(ctx, views, k, segment)
        if packed is None:
            return None
        spec, segment_written, segment_read = packed
        specs.append(spec)
        written += segment_written
        read += segment_read
    spec = ";".join(specs)

    def adam_groups(groups, *, step, decoupled, grad_scale, found_inf) -> None:
        (_, _, _, _, hyper), = groups  # the views are this group's, planned above
        compiled_stored.adam_stored(written, read, spec, hyper, step=step, decoupled=decoupled,
                                    grad_scale=grad_scale, found_inf=found_inf)

    def adam(params, grads, exp_avgs, exp_avg_sqs, *, step, decoupled, grad_scale, found_inf, **hyper) -> None:
        adam_groups([(params, grads, exp_avgs, exp_avg_sqs, hyper)], step=step, decoupled=decoupled,
                    grad_scale=grad_scale, found_inf=found_inf)

    return types.SimpleNamespace(adam_groups=adam_groups, adam=adam, LIVE_FIELDS=compiled_stored.LIVE_FIELDS,
                                 spec=spec)


def _encoding(storage: Optional[precision.Storage]) -> str:
    if storage is None or storage.dtype == torch.float32:
        return "f32"
    if storage.remainder:
        return "rem"
    code = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float8_e4m3fn: "f8"}[storage.dtype]
    if storage.range != compiled_stored.RANGES.get(code, storage.range) or storage.scaled != (code != "bf16"):
        raise ValueError(f"stored_kernel: {storage} does not match the compiled kernel's {code!r} encoding: keep "
                         "graphstep/kernels/compiled_stored.py's RANGES in step with graphstep/state/precision.py")
    return code


def _segment(ctx, views, k: int, segment):
    """(its ``SegmentSpec`` text, written tensors, read tensors) of segment ``k``; None where not supported."""
    buffers, numel = ctx.buffers, segment.numel
    stored = fp32_windows.stored_in(buffers, segment.buffer)
    whole, pieces = {}, None
    for kind in _KINDS:
        state = stored.get(kind)
        if state is None:
            view = views.params[k] if kind == "main" else views.state[kind][k]
            if view.dtype != torch.float32:
                return None  # main params computed in bf16: the eager windows' case
            whole[kind] = ("f32", (view,), None)
            continue
        start = fp32_windows.offset(buffers, kind, segment)
        i, j = state.pieces(start, start + numel)
        relative = [s - start for s in state.starts[i:j]]
        if pieces is not None and relative != pieces:
            return None
        pieces = relative
        code = _encoding(state.storage)
        data = state.data[start:start + numel]
        if code == "rem":
            tensors = (state.high(start, start + numel).view(torch.int16), data)
        else:
            tensors = (data.view(torch.uint8) if code == "f8" else data,)
        whole[kind] = (code, tensors, None if state.scales is None else state.scales[i:j])
    codes = tuple(whole[kind][0] for kind in _KINDS)
    scaled = any(code in compiled_stored.RANGES for code in codes)
    width = _width(pieces, numel) if scaled else _MAX_WIDTH
    cuts = [(lo, hi, w) for lo, hi, w in ((0, numel - numel % width, width), (numel - numel % width, numel, 1))
            if hi > lo]
    parts, rows = [], []
    grad = views.grads[k]
    for lo, hi, w in cuts:
        stored_parts = tuple(tuple(t[lo:hi].view(-1, w) for t in whole[kind][1]) for kind in _KINDS)
        parts.append((stored_parts, grad.detach()[lo:hi].view(-1, w)))
        if scaled:
            rows.append(_row_index(pieces, lo, hi, w, grad.device))
    spec = compiled_stored.SegmentSpec(*codes, tuple(w for _, _, w in cuts))
    written, read = compiled_stored.pack(parts, tuple(whole[kind][2] for kind in _KINDS), rows if scaled else None)
    return spec.text(), written, read


def _width(pieces: list[int], numel: int) -> int:
    """The widest power of two up to ``_MAX_WIDTH`` whose rows each hold at most one piece boundary inside."""
    width = _MAX_WIDTH
    while width > 1:
        inner = [s for s in pieces[1:] if s % width]
        rows = [s // width for s in inner]
        if len(rows) == len(set(rows)):
            return width
        width //= 2
    return 1


def _row_index(pieces: list[int], lo: int, hi: int, width: int, device) -> tuple:
    """Per row of [lo, hi) cut into rows of ``width``: its first piece, its second (the first where none) and the
    column where the second begins (``width`` where none), pieces counted from the segment's first."""
    starts = torch.tensor(pieces, dtype=torch.int64)
    row_starts = torch.arange(lo, hi, width, dtype=torch.int64)
    first = torch.searchsorted(starts, row_starts, right=True) - 1
    last = torch.searchsorted(starts, row_starts + width - 1, right=True) - 1
    split = torch.where(last > first, starts[last.clamp(max=len(pieces) - 1)] - row_starts, width)
    return first.to(device), last.to(device), split.to(device, torch.float32)
