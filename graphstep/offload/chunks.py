"""What the host update does, cut at build into chunks: kernel calls over host views and H2D copies.

A chunk is a contiguous range of the host part of one flat buffer, cut between params. For each chunk
the build precomputes, once: per param group, the group's views of the host buffers inside the chunk
(main params, grads, state), the family's kernel call and its hyperparameter sources; and the copies that
bring the updated params back to the device (main -> staging in the model dtype, staging ->
``param_flat``). Without ``overlap_cpu_optimizer_d2h_h2d`` there is one chunk per flat buffer (one kernel
call per group and buffer, like the device update); with it, about ``OVERLAP_CHUNKS`` chunks per buffer,
ordered for the next forward (see ``forward_order``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..families import GroupViews

# With overlap: about this many chunks per flat buffer (whole params each, so fewer for a few big ones).
# Four keep the copies of one chunk overlapping the update of the next without many tiny kernel calls.
OVERLAP_CHUNKS = 4


@dataclass(frozen=True)
class GroupCall:
    family: object  # graphstep.families.Family
    kernels: object  # its kernels module
    views: GroupViews
    live: tuple  # (keyword, field, group)
    baked: tuple  # (keyword, row, column)


@dataclass(frozen=True)
class Chunk:
    buffer: int
    start: int  # host offsets [start, end) of host part of the buffer
    end: int
    calls: tuple[GroupCall, ...]
    staging: tuple  # (staging view, main view) to cast, or () for fp32 params
    copies: tuple  # (param_flat view, host source view): the H2D copies
    params: frozenset  # param indices whose pieces the chunk holds (what forward pre-hooks wait on)


def _cut_points(plan, layout, buffer: int, chunks_per_buffer: int) -> list[int]:
    """Host offsets where chunks of ``buffer`` start: piece starts, about equally spaced."""
    split, size = plan.splits[buffer], plan.host_size(buffer)
    starts = sorted({r.shard_start - split for r in plan.host_ranges
                     if layout.params[r.param].buffer == buffer and r.shard_start >= split})
    target = -(-size // max(1, chunks_per_buffer))
    points, last = [0], 0
    for s in starts:
        if s - last >= target:
            points.append(s)
            last = s
    return points


def build_chunks(ctx, host, *, overlap: bool) -> list[Chunk]:
    layout, buffers, plan, hyper = ctx.layout, ctx.buffers, host.plan, ctx.hyper
    chunks = []
    segments = layout.segments(ctx.rank)
    for b, buf in enumerate(layout.buffers):
        split, size = plan.splits[b], plan.host_size(b)
        if size == 0:
            continue
        points = _cut_points(plan, layout, b, OVERLAP_CHUNKS if overlap else 1) + [size]
        for lo, hi in zip(points[:-1], points[1:]):
            calls = []
            for group, family in enumerate(ctx.families):
                spans = []
                for s in segments:
                    if s.buffer != b or s.group != group:
                        continue
                    start, end = max(s.shard_start - split, lo), min(s.shard_end - split, hi)
                    if end > start:
                        spans.append((start, end))
                if not spans:
                    continue

                def cut(tensor):
                    return [tensor[start:end] for start, end in spans]

                views = GroupViews(cut(host.main[b]), cut(host.grads[b]),
                                   {name: cut(t[b]) for name, t in host.state.items()})
                live_fields = family.live_fields(ctx.kernels)
                live, baked = [], []
                for keyword, field in family.hyperparameters:
                    if field in live_fields:
                        live.append((keyword, field, group))
                    else:
                        baked.append((keyword, *hyper.position(field, group)))
                calls.append(GroupCall(family, family.kernels_for(ctx.kernels), views, tuple(live), tuple(baked)))
            staging = host.staging[b]
            source = host.params_source(b)
            casts = () if staging is None else ((staging[lo:hi], host.main[b][lo:hi]),)
            copies = tuple(_param_copies(ctx, b, split, lo, hi, source))
            params = frozenset(r.param for r in plan.host_ranges if layout.params[r.param].buffer == b
                               and lo <= r.shard_start - split < hi)
            chunks.append(Chunk(b, lo, hi, tuple(calls), casts, copies, params))
    return forward_order(chunks)


def flat_pieces(ctx, b: int, start: int, end: int):
    """(flat offset, shard offset, numel) per bucket of buffer ``b`` overlapping shard offsets [start, end).

    A rank's shard of a buffer is the concatenation of its shards of the buffer's buckets, which are not
    contiguous in the flat buffers: bucket by bucket, a shard range maps to ``bucket.shard_range(rank)``.
    """
    layout = ctx.layout
    for index in layout.buffers[b].buckets:
        bucket = layout.buckets[index]
        lo, hi = max(bucket.shard_offset, start), min(bucket.shard_offset + bucket.shard_numel, end)
        if hi > lo:
            yield bucket.shard_range(ctx.rank)[0] + lo - bucket.shard_offset, lo, hi - lo


def _param_copies(ctx, b: int, split: int, lo: int, hi: int, source: torch.Tensor):
    """(param_flat view, host view) pairs covering host offsets [lo, hi) of buffer ``b``."""
    param_flat = ctx.buffers.param_flat[b]
    for flat, start, numel in flat_pieces(ctx, b, split + lo, split + hi):
        yield param_flat[flat:flat + numel], source[start - split:start - split + numel]


def forward_order(chunks: list[Chunk]) -> list[Chunk]:
    """Last buffer first, and inside a buffer from the end of the shard: the layout orders buckets by
    backward, so this is roughly the order in which the next forward uses the params."""
    return sorted(chunks, key=lambda c: (-c.buffer, -c.start))
