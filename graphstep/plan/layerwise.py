"""Layer-wise sharding: which data-parallel rank owns which whole matrix, and where each rank's matrices sit.

Muon's Newton–Schulz needs whole matrices, so its params are not cut into element shards: each rank owns whole
matrices (Megatron-Core's ``LayerWiseDistributedOptimizer``). graphstep keeps its one mechanism, even element
shards of padded buckets, and only orders a *layer-wise bucket* so that rank r's section holds exactly the
matrices rank r owns, each section padded to the same size: the step is unchanged. Owners are assigned by greedy
longest-processing-time over the Newton–Schulz cost ``max(r, c)·min(r, c)²`` (``assign_owners``), with loads
carried from one buffer to the next. Pure and deterministic on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


def ns_cost(shape: Sequence[int]) -> int:
    """Newton–Schulz cost of one matrix: its Gram matmuls cost ~ max·min² multiply-adds per step."""
    if len(shape) == 2:
        rows, cols = shape
        return max(rows, cols) * min(rows, cols) ** 2
    return math.prod(shape)


def assign_owners(costs: Sequence[int], dp_size: int, loads: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """Per item, the rank that owns it, by greedy longest-processing-time over ``costs``: items by decreasing
    cost (ties: lower index first), each to the least-loaded rank (ties: lower rank).

    ``loads``: the ranks' loads before these items (e.g. from earlier buckets), so balance carries over.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size}: must be >= 1")
    loads = [0] * dp_size if loads is None else list(loads)
    if len(loads) != dp_size:
        raise ValueError(f"{len(loads)} loads for {dp_size} ranks")
    owners = [0] * len(costs)
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        owners[item] = rank
        loads[rank] += costs[item]
    return tuple(owners)


def rank_loads(costs: Sequence[int], owners: Sequence[int], dp_size: int) -> list[int]:
    """Each rank's total cost under ``owners``."""
    loads = [0] * dp_size
    for cost, owner in zip(costs, owners):
        loads[owner] += cost
    return loads


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Sections:
    """One layer-wise bucket's arrangement: ``order[r]`` lists (item, offset inside rank r's section)."""

    order: tuple[tuple[tuple[int, int], ...], ...]
    section_numel: int  # S: every rank's section, padded to the largest

    @property
    def numel(self) -> int:
        return self.section_numel * len(self.order)


def plan_sections(numels: Sequence[int], sort_keys: Sequence[tuple], owners: Sequence[int], dp_size: int, *,
                  param_alignment: int, section_alignment: int) -> Sections:
    """Arrange items (matrices) into ``dp_size`` equal sections, rank r's section holding the items it owns.

    Items start on multiples of ``param_alignment`` inside a section; the section size is the largest
    rank's aligned total rounded up to ``section_alignment`` (a multiple of ``param_alignment``), so every
    section, and so every item, starts aligned when the bucket does. Within a section items are sorted
    by ``sort_keys`` (then input order).
    """
    if section_alignment % param_alignment:
        raise ValueError(f"section_alignment={section_alignment} is not a multiple of param_alignment="
                         f"{param_alignment}")
    order = []
    used = []
    for rank in range(dp_size):
        mine = sorted((i for i in range(len(numels)) if owners[i] == rank), key=lambda i: (sort_keys[i], i))
        offset, placed = 0, []
        for i in mine:
            placed.append((i, offset))
            offset = _round_up(offset + numels[i], param_alignment)
        order.append(tuple(placed))
        used.append(offset)
    section = max(section_alignment, _round_up(max(used), section_alignment))
    return Sections(tuple(order), section)


@dataclass(frozen=True)
class Balance:
    """How well a layout spreads Newton–Schulz work and how much padding its layer-wise buckets add."""

    dp_size: int
    loads: tuple[int, ...]  # NS cost per rank
    matrix_numel: int  # elements of the layer-wise params
    bucket_numel: int  # elements of the layer-wise buckets (what is reduce-scattered and all-gathered)

    @property
    def max_over_mean(self) -> float:
        mean = sum(self.loads) / self.dp_size
        return max(self.loads) / mean if mean else 1.0

    @property
    def padding_fraction(self) -> float:
        return (self.bucket_numel - self.matrix_numel) / self.matrix_numel if self.matrix_numel else 0.0


def balance(layout) -> Balance:
    """The NS-cost balance and padding of ``layout``'s layer-wise buckets (a graphstep.layout.Layout)."""
    loads = [0] * layout.dp_size
    matrix_numel = bucket_numel = 0
    for bucket in layout.buckets:
        if not bucket.whole_matrices:
            continue
        bucket_numel += bucket.numel
        for i in bucket.params:
            place = layout.params[i]
            matrix_numel += place.numel
            loads[(place.start - bucket.start) // bucket.shard_numel] += ns_cost(place.shape)
    return Balance(layout.dp_size, tuple(loads), matrix_numel, bucket_numel)
