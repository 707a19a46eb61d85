"""plan_offload(): which part of this rank's shard lives on the host. Pure data, like layout.py.

Whole param pieces are taken from the *end* of the rank's shard backwards while the elements taken are below
``fraction`` of the shard (Megatron-Core's ``HybridDeviceOptimizer`` rule, walked over the layout instead of
its groups); deterministic, so every rank knows which buckets any rank updates on the host. A suffix makes the
host part of each flat buffer one contiguous range ``[split[b], shard_numel)`` and the device part the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan.layout import Layout, OwnedRange


@dataclass(frozen=True)
class OffloadPlan:
    rank: int
    splits: tuple[int, ...]  # per flat buffer: shard elements [0, split) on the device, [split, end) on the host
    shard_numels: tuple[int, ...]
    host_ranges: tuple[OwnedRange, ...]  # the params' pieces updated on the host, in shard order
    owned_numel: int  # this rank's param elements (padding excluded)

    @property
    def host_numel(self) -> int:
        """Host elements of the shard, padding inside the host ranges included."""
        return sum(n - s for n, s in zip(self.shard_numels, self.splits))

    @property
    def host_param_numel(self) -> int:
        """Param elements updated on the host (padding excluded)."""
        return sum(r.param_end - r.param_start for r in self.host_ranges)

    def host_size(self, buffer: int) -> int:
        return self.shard_numels[buffer] - self.splits[buffer]

    @property
    def any_host(self) -> bool:
        return self.host_numel > 0


def plan_offload(layout: Layout, rank: int, fraction: float) -> OffloadPlan:
    """The host part of ``rank``'s shard for ``optimizer_offload_fraction=fraction`` (module docstring)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload fraction {fraction}: must lie in [0, 1]")
    owned = sorted(layout.owned_ranges(rank),
                   key=lambda r: (layout.params[r.param].buffer, r.shard_start))
    total = sum(r.param_end - r.param_start for r in owned)
    threshold = fraction * total
    taken: list[OwnedRange] = []
    count = 0
    for piece in reversed(owned):
        if count >= threshold:
            break
        taken.append(piece)
        count += piece.param_end - piece.param_start
    taken.reverse()

    shard_numels = tuple(buf.shard_numel for buf in layout.buffers)
    splits = list(shard_numels)
    per_buffer_owned = [0] * len(layout.buffers)
    per_buffer_taken = [0] * len(layout.buffers)
    for piece in owned:
        per_buffer_owned[layout.params[piece.param].buffer] += 1
    for piece in taken:
        b = layout.params[piece.param].buffer
        per_buffer_taken[b] += 1
        splits[b] = min(splits[b], piece.shard_start)
    for b in range(len(splits)):
        # A buffer whose every piece is on the host goes there whole (leading padding included), so that
        # fraction 1 leaves no device main params or state at all.
        if per_buffer_owned[b] and per_buffer_taken[b] == per_buffer_owned[b]:
            splits[b] = 0
    return OffloadPlan(rank, tuple(splits), shard_numels, tuple(taken), total)


def host_buckets(layout: Layout, fraction: float) -> tuple[int, ...]:
    """Buckets any rank updates (partly) on the host: their all-gather must wait for the host update.
    A pure function of the layout, so every rank computes the same tuple."""
    touched = set()
    for rank in range(layout.dp_size):
        plan = plan_offload(layout, rank, fraction)
        for b, buf in enumerate(layout.buffers):
            if plan.host_size(b) == 0:
                continue
            for index in buf.buckets:
                bucket = layout.buckets[index]
                if bucket.shard_offset + bucket.shard_numel > plan.splits[b]:
                    touched.add(index)
    return tuple(sorted(touched))
