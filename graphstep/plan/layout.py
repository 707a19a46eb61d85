"""plan_layout(): where every parameter lives in the flat buffers, and which rank owns which part.

Pure data from a pure function: no allocation, no torch.distributed, testable with fake shapes. The rules are
Megatron-Core's distributed-optimizer layout (``_ParamAndGradBuffer``): one flat buffer per (param dtype, grad
dtype); params fill buckets in backward order, each aligned to ``PARAM_ALIGNMENT``; a bucket closes once the
unpadded end of its last param reaches ``bucket_size`` and is padded to a multiple of lcm(dp, 128), so it splits
into ``dp`` equal shards that ignore param boundaries. graphstep always pads (the update runs over aligned views,
sharded or not), and orders params inside a bucket by param group, so each shard meets each group in one
contiguous segment (by shape too for ``batch_by_shape`` groups). With several ranks, Muon's groups go into one
more, layer-wise bucket per buffer (graphstep/plan/layerwise.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import layerwise

PARAM_ALIGNMENT = 64
BUCKET_ALIGNMENT = 128
DEFAULT_MIN_BUCKET_SIZE = 40_000_000
DEFAULT_BUCKET_SIZE_PER_RANK = 1_000_000


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    grad_dtype: torch.dtype
    group: int
    batch_by_shape: bool = False  # its group's update needs whole matrices, batched by shape (Muon): sort by
    # shape, and with several ranks shard layer-wise (whole matrices per rank)
    counted_in_norm: bool = True  # False: a copy another rank counts (graphstep/plan/model_parallel.py); its
    # grads still take part in the non-finite check. Such params get buffers of their own.
    zero_tail: int = 0  # its last elements are padding outside the model (an FSDP2 model's uneven shards,
    # graphstep/fsdp2/shards.py): always zero, left out of num_zeros like the layout's own padding

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamPlacement:
    """One parameter's place: ``[start, start + numel)`` of buffer ``buffer``, inside bucket ``bucket``."""

    index: int  # position in the input list of ParamSpecs
    name: str
    shape: tuple[int, ...]
    group: int
    buffer: int
    bucket: int  # index into Layout.buckets
    start: int
    zero_tail: int = 0  # ParamSpec.zero_tail

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Bucket:
    """A contiguous, padded range of one buffer that is reduced and gathered as a unit."""

    index: int
    buffer: int
    start: int
    end: int  # padded: (end - start) % dp == 0
    params: tuple[int, ...]  # ParamSpec indices, in buffer order
    dp_size: int
    shard_offset: int  # where this bucket's shard starts inside a rank's shard of the buffer
    whole_matrices: bool = False  # layer-wise: each rank's shard holds whole matrices (graphstep.layerwise)

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def shard_numel(self) -> int:
        return self.numel // self.dp_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The flat-buffer range of this bucket that ``rank`` owns."""
        start = self.start + rank * self.shard_numel
        return start, start + self.shard_numel


@dataclass(frozen=True)
class BufferLayout:
    index: int
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    numel: int
    buckets: tuple[int, ...]  # indices into Layout.buckets
    shard_numel: int  # elements of this buffer each rank owns (sum of its buckets' shards)
    counted_in_norm: bool = True  # its params' grads count in the grad norm on this rank (ParamSpec)


@dataclass(frozen=True)
class Segment:
    """A contiguous run of one param group inside one rank's shard of one bucket.

    ``shard_start``/``shard_end`` index the rank's shard of the buffer (main params, optimizer state);
    ``flat_start``/``flat_end`` index the full buffer (params, grads). Padding between params of the group
    lies inside the segment; it stays zero because its grads are zero.
    """

    buffer: int
    bucket: int
    group: int
    shard_start: int
    shard_end: int
    flat_start: int
    flat_end: int

    @property
    def numel(self) -> int:
        return self.shard_end - self.shard_start


@dataclass(frozen=True)
class OwnedRange:
    """The part ``[param_start, param_end)`` of a param's flattened elements that a rank owns."""

    param: int
    rank: int
    param_start: int
    param_end: int
    flat_start: int
    shard_start: int


@dataclass(frozen=True)
class Layout:
    params: tuple[ParamPlacement, ...]  # in input order
    buckets: tuple[Bucket, ...]
    buffers: tuple[BufferLayout, ...]
    dp_size: int
    num_groups: int

    def owned_ranges(self, rank: int) -> tuple[OwnedRange, ...]:
        """For every param that ``rank`` owns a piece of, which piece (possibly a sub-range)."""
        owned = []
        for place in self.params:
            bucket = self.buckets[place.bucket]
            lo, hi = bucket.shard_range(rank)
            start, end = max(place.start, lo), min(place.end, hi)
            if start < end:
                owned.append(OwnedRange(place.index, rank, start - place.start, end - place.start, start,
                                        bucket.shard_offset + start - lo))
        return tuple(owned)

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """Per (bucket, group), the contiguous run of ``rank``'s shard the group's params cover."""
        segments = []
        for bucket in self.buckets:
            lo, hi = bucket.shard_range(rank)
            by_group: dict[int, list[int]] = {}
            for i in bucket.params:
                place = self.params[i]
                start, end = max(place.start, lo), min(place.end, hi)
                if start < end:
                    span = by_group.setdefault(place.group, [start, end])
                    span[0], span[1] = min(span[0], start), max(span[1], end)
            for group, (start, end) in by_group.items():
                segments.append(Segment(bucket.buffer, bucket.index, group,
                                        bucket.shard_offset + start - lo, bucket.shard_offset + end - lo,
                                        start, end))
        return tuple(segments)

    def padding_numel(self, rank: Optional[int] = None, buffers: Optional[Sequence[int]] = None) -> int:
        """Elements that belong to no param, or to a param's ``zero_tail``: in the whole buffers, or in
        ``rank``'s shards; of every buffer, or of ``buffers`` only."""
        chosen = set(range(len(self.buffers)) if buffers is None else buffers)
        if rank is None:
            return (sum(self.buffers[b].numel for b in chosen)
                    - sum(p.numel - p.zero_tail for p in self.params if p.buffer in chosen))
        owned = 0
        for r in self.owned_ranges(rank):
            place = self.params[r.param]
            if place.buffer in chosen:
                tail = max(0, r.param_end - max(r.param_start, place.numel - place.zero_tail))
                owned += r.param_end - r.param_start - tail
        return sum(self.buffers[b].shard_numel for b in chosen) - owned

    def shard_entries_counted(self) -> list[bool]:
        """Per ``grad_shard`` entry (graphstep/state/buffers.py: a whole buffer with one rank, a bucket's shard
        with several), whether its grads count in the norm on this rank (``BufferLayout.counted_in_norm``)."""
        if self.dp_size == 1:
            return [b.counted_in_norm for b in self.buffers]
        return [self.buffers[bucket.buffer].counted_in_norm for bucket in self.buckets]

    def fingerprint(self) -> tuple:
        """A value equal on two ranks exactly when they planned the same layout (checked at build)."""
        return (self.dp_size, self.num_groups,
                tuple((p.name, p.shape, p.group, p.buffer, p.start) for p in self.params),
                tuple((str(b.param_dtype), str(b.grad_dtype), b.numel, b.counted_in_norm) for b in self.buffers))


def default_bucket_size(dp_size: int) -> int:
    return max(DEFAULT_MIN_BUCKET_SIZE, DEFAULT_BUCKET_SIZE_PER_RANK * dp_size)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _buffer_key(spec: ParamSpec) -> tuple[torch.dtype, torch.dtype, bool]:
    """Params share a flat buffer when they share dtypes and whether they count in the norm on this rank."""
    return spec.dtype, spec.grad_dtype, spec.counted_in_norm


def _in_bucket_key(spec: ParamSpec) -> tuple:
    """Group first; within a group that batches by shape (Muon), shape next, so same-shape matrices are
    contiguous and evenly spaced (one (n, r, c) view covers them: families/matrix_views.py)."""
    return (spec.group, spec.shape if spec.batch_by_shape else ())


def _chunks(indices: Sequence[int], specs: Sequence[ParamSpec], bucket_size: int) -> list[list[int]]:
    """Split backward-ordered params into buckets (the rule in the module docstring). ``used`` is where
    the open bucket's last param ends, relative to the bucket's start, before any padding."""
    chunks: list[list[int]] = [[]]
    used = 0
    for i in indices:
        chunks[-1].append(i)
        used = _round_up(used, PARAM_ALIGNMENT) + specs[i].numel
        if used >= bucket_size:
            chunks.append([])
            used = 0
    if not chunks[-1]:
        chunks.pop()
    return chunks


def plan_layout(specs: Sequence[ParamSpec], dp_size: int = 1, bucket_size: Optional[int] = None) -> Layout:
    """Place ``specs`` (in model order) into flat buffers, buckets and per-rank shards."""
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size}: must be >= 1")
    if not specs:
        raise ValueError("plan_layout: no parameters to lay out (does the model have trainable params?)")
    bucket_size = default_bucket_size(dp_size) if bucket_size is None else bucket_size
    if bucket_size < 1:
        raise ValueError(f"bucket_size={bucket_size}: must be >= 1")
    bucket_multiple = math.lcm(dp_size, BUCKET_ALIGNMENT)

    keys: list[tuple[torch.dtype, torch.dtype, bool]] = []
    for spec in specs:
        if spec.numel == 0:
            raise ValueError(f"parameter '{spec.name}' has no elements; drop it or freeze it")
        key = _buffer_key(spec)
        if key not in keys:
            keys.append(key)

    placements: dict[int, ParamPlacement] = {}
    ns_loads = [0] * dp_size  # Newton–Schulz cost per rank over the layer-wise buckets planned so far
    buckets: list[Bucket] = []
    buffers: list[BufferLayout] = []
    for buffer_index, key in enumerate(keys):
        backward = [i for i in reversed(range(len(specs))) if _buffer_key(specs[i]) == key]
        # With several ranks, whole-matrix params (Muon's) get layer-wise buckets of their own, after the
        # element-sharded ones (graphstep.layerwise).
        whole = [i for i in backward if dp_size > 1 and specs[i].batch_by_shape]
        chunks = _chunks([i for i in backward if not (dp_size > 1 and specs[i].batch_by_shape)], specs, bucket_size)

        offset = 0
        shard_offset = 0
        bucket_indices = []
        for chunk in chunks:
            ordered = sorted(chunk, key=lambda i: _in_bucket_key(specs[i]))  # stable: backward order within
            start = offset
            for i in ordered:
                spec = specs[i]
                placements[i] = ParamPlacement(i, spec.name, tuple(spec.shape), spec.group, buffer_index,
                                               len(buckets), offset, spec.zero_tail)
                offset = _round_up(offset + spec.numel, PARAM_ALIGNMENT)
            end = start + _round_up(offset - start, bucket_multiple)
            bucket = Bucket(len(buckets), buffer_index, start, end, tuple(ordered), dp_size, shard_offset)
            buckets.append(bucket)
            bucket_indices.append(bucket.index)
            shard_offset += bucket.shard_numel
            offset = end
        if whole:
            # One layer-wise bucket for all of them, whatever bucket_size says: LPT then balances the whole
            # buffer's NS work, and the sections' padding stays tiny (cut into bucket_size chunks, a chunk
            # of few matrices pads every other rank's section to its largest one). The price: its
            # reduce-scatter waits for the last matrix's grad, so overlap_grad_reduce overlaps only the
            # element-sharded buckets.
            costs = [layerwise.ns_cost(specs[i].shape) for i in whole]
            owners = layerwise.assign_owners(costs, dp_size, ns_loads)  # balance across buffers too
            ns_loads = [a + b for a, b in zip(ns_loads, layerwise.rank_loads(costs, owners, dp_size))]
            sections = layerwise.plan_sections(
                [specs[i].numel for i in whole], [_in_bucket_key(specs[i]) for i in whole], owners, dp_size,
                param_alignment=PARAM_ALIGNMENT, section_alignment=BUCKET_ALIGNMENT)
            ordered = []
            for rank, placed in enumerate(sections.order):
                for item, section_offset in placed:
                    i = whole[item]
                    placements[i] = ParamPlacement(i, specs[i].name, tuple(specs[i].shape), specs[i].group,
                                                   buffer_index, len(buckets),
                                                   offset + rank * sections.section_numel + section_offset,
                                                   specs[i].zero_tail)
                    ordered.append(i)
            bucket = Bucket(len(buckets), buffer_index, offset, offset + sections.numel, tuple(ordered), dp_size,
                            shard_offset, whole_matrices=True)
            buckets.append(bucket)
            bucket_indices.append(bucket.index)
            shard_offset += bucket.shard_numel
            offset = bucket.end
        buffers.append(BufferLayout(buffer_index, key[0], key[1], offset, tuple(bucket_indices), shard_offset,
                                    counted_in_norm=key[2]))

    num_groups = max(spec.group for spec in specs) + 1
    return Layout(tuple(placements[i] for i in range(len(specs))), tuple(buckets), tuple(buffers), dp_size,
                  num_groups)
