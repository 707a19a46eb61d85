"""Ranks decide together whether a captured step is still valid (docs/design.md §9).

A captured collective must be replayed by every rank from the same capture: if one rank recaptures while its
peers replay the old graph, the collectives pair up wrongly and the job hangs or reads garbage. So before each
run of a capturable step, and around a capture, the ranks sharing its collectives MAX-all-reduce one "my step
went stale" flag and all act on it alike. The flag is a CPU tensor on a gloo group of its own: a host round trip
per step, never a device sync. With a model-parallel group every rank of the job takes part (agreement is
transitive across both groups).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .collectives import host_group


class RankAgreement:
    def __init__(self, dp_group: Optional[dist.ProcessGroup], mp_group: Optional[dist.ProcessGroup],
                 timeout_s: float, dp_host_group: Optional[dist.ProcessGroup] = None):
        if mp_group is not None:
            ranks = list(range(dist.get_world_size()))
        else:
            ranks = dist.get_process_group_ranks(dp_group)
        self.ranks = ranks
        if mp_group is None and dp_host_group is not None:  # the collectives' gloo group has these very ranks
            self._group = dp_host_group
        else:
            self._group = host_group(ranks, timeout_s)
        self._flag = torch.zeros(1, dtype=torch.int32)

    def any(self, flag: bool) -> bool:
        """True when ``flag`` is set on any of the ranks (collective: every rank calls it at the same step)."""
        self._flag.fill_(int(flag))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(self._flag[0])  # a host tensor: no device sync


def agreement_for(dp_group, mp_group, timeout_s: float, dp_host_group=None) -> Optional[RankAgreement]:
    """The agreement for a step over these groups, or None when the step runs on one process.
    ``dp_host_group``: a gloo group over the data-parallel ranks to reuse (``Collectives.host_group``)."""
    if dp_group is None and mp_group is None:
        return None
    return RankAgreement(dp_group, mp_group, timeout_s, dp_host_group)
