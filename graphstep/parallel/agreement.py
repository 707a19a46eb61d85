"""Ranks decide together whether a captured step is still valid (docs/design.md §9).

A captured NCCL collective must be replayed by every rank from the same capture: if one rank recaptures
(a param it replaced, a baked value that changed on it alone) while its peers replay the old graph, the
collectives pair up wrongly and the job hangs or reads garbage. So before each run of a capturable step,
the ranks that share its collectives exchange one flag — "my step went stale" — and all of them act on
the logical OR: all recapture at the same step, or all raise. The same exchange brackets a capture, so
no rank starts recording while a peer is still replaying.

The exchange is host-side: a one-element CPU tensor all-reduced (MAX) over a gloo group of its own,
created at build. It never touches the device, so it adds no device sync to the step; it costs one small
host round trip per step (tens of microseconds on one host over loopback). Which ranks take part: the
data-parallel group's; with a model-parallel group as well, every rank of the job, since the ranks linked
by either group must agree transitively.
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
