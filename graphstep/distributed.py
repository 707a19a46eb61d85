"""Collectives over torch.distributed for the step: explicit process groups, no global state.

With one process every call here is a no-op, so the single-process step runs the same stage code.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class Collectives:
    """The step's collectives over a data-parallel group and an optional model-parallel group."""

    def __init__(self, dp_group: Optional[dist.ProcessGroup] = None, dp_size: int = 1,
                 mp_group: Optional[dist.ProcessGroup] = None):
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.mp_group = mp_group

    @property
    def reduces_grad_stats(self) -> bool:
        """Whether grad statistics (norm, zero count) are summed across processes."""
        return self.dp_size > 1 or self.mp_group is not None

    def all_reduce_sum(self, tensor: torch.Tensor, what: str) -> None:
        """Sum ``tensor`` in place over the data-parallel, then the model-parallel group."""
        if self.dp_size > 1:
            dist.all_reduce(tensor, group=self.dp_group)
        if self.mp_group is not None:
            dist.all_reduce(tensor, group=self.mp_group)
