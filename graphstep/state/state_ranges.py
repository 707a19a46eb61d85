"""Where each optimizer-state buffer holds its elements: only over the groups whose family keeps it.

A state name (``exp_avg``, ``momentum_buffer``, ...) is kept by the families that declare it
(graphstep/families/); a model mixing families (Muon's matrices + Adam's scalar params) would waste
memory if every state buffer spanned the whole shard. So per state name and flat buffer the state tensor
is *compact*: the concatenation, in shard order, of the segments (layout.py's ``Segment``: one group's
contiguous run of this rank's shard of one bucket) of the groups that keep the name. ``StateRanges``
maps a range of shard coordinates to its offset in that compact tensor.

Where every group keeps the name (one family: the common case) or the shard has a host part (CPU
offload addresses state as the shard's device prefix and host suffix, graphstep/offload/), the range is
the whole shard and the mapping is the identity: the layout, bytes and addresses are as without it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..plan.layout import Layout


@dataclass(frozen=True)
class StateRanges:
    """One state name's ranges: per flat buffer, sorted ``(shard_start, shard_end, offset)`` runs of the
    shard it holds, ``offset`` being where the run starts in the compact tensor; ``None`` for a buffer
    held whole (identity)."""

    runs: tuple[Optional[tuple[tuple[int, int, int], ...]], ...]
    numel: tuple[int, ...]  # per buffer: the compact tensor's length

    def whole(self, buffer: int) -> bool:
        return self.runs[buffer] is None

    def offset(self, buffer: int, shard_start: int, numel: int) -> Optional[int]:
        """Where shard elements ``[shard_start, shard_start + numel)`` sit in the compact tensor of
        ``buffer``, or None when the name is not kept there (another family's elements)."""
        runs = self.runs[buffer]
        if runs is None:
            return shard_start
        i = bisect.bisect_right(runs, (shard_start, float("inf"), 0)) - 1
        if i < 0:
            return None
        start, end, offset = runs[i]
        if shard_start + numel > end:
            return None
        return offset + shard_start - start

    def compact(self, buffer: int, full):
        """A whole shard's tensor of ``buffer`` (the old, full-size checkpoint shape) reduced to the
        elements kept here, in the compact order."""
        runs = self.runs[buffer]
        if runs is None:
            return full
        return torch.cat([full[start:end] for start, end, _ in runs]) if runs else full[:0]


def plan_state_ranges(layout: Layout, rank: int, group_states: Sequence[Sequence[str]], names: Sequence[str],
                      *, whole: bool) -> dict[str, StateRanges]:
    """Per state name in ``names``, where it is kept on ``rank``. ``group_states[g]``: the names group g's
    family keeps; ``whole``: hold every name over the whole shard (CPU offload)."""
    shard_numel = tuple(b.shard_numel for b in layout.buffers)
    identity = StateRanges(tuple(None for _ in layout.buffers), shard_numel)
    segments = sorted(layout.segments(rank), key=lambda s: (s.buffer, s.shard_start))
    present = {p.group for p in layout.params}
    plans = {}
    for name in names:
        keepers = {g for g, kept in enumerate(group_states) if name in kept}
        if whole or keepers >= present or _overlapping(segments):
            plans[name] = identity
            continue
        runs, numel = [], []
        for b in range(len(layout.buffers)):
            offset, mine = 0, []
            for s in segments:
                if s.buffer == b and s.group in keepers:
                    mine.append((s.shard_start, s.shard_end, offset))
                    offset += s.numel
            runs.append(tuple(mine))
            numel.append(offset)
        plans[name] = StateRanges(tuple(runs), tuple(numel))
    return plans


def _overlapping(segments) -> bool:
    """Whether two groups' segments share shard elements (a layout that interleaves groups): then no
    compact order exists and the state stays whole."""
    return any(a.buffer == b.buffer and b.shard_start < a.shard_end for a, b in zip(segments, segments[1:]))
