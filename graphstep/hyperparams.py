"""Device tensors for everything a schedule may change, refreshed from ``param_groups`` before each step.

Schedulers (torch's and graphstep's) write Python floats into ``param_groups``. A Python float read inside
the step would be baked into a captured graph forever (DESIGN.md law 3), so the step reads these tensors
instead; ``refresh`` copies the current floats in with one small host-to-device copy, outside the graph.

Layout: one ``values`` tensor of shape (num_groups + 1, len(FIELDS)); row g holds group g, the last row
holds the step-wide scalars (clip threshold, skip threshold). Each hyperparameter is a 0-d view of it, so
its address never changes.

dtype: float64 on the CPU, where torch's optimizers do their scalar math in double: an fp64 lr tensor
makes the fused kernel bitwise equal to ``torch.optim.AdamW(fused=True)`` with a float lr (DESIGN.md §8).
float32 elsewhere, the dtype the fused GPU kernels read a tensor lr in.
"""

from __future__ import annotations

from typing import Sequence

import torch

GROUP_FIELDS = ("lr", "weight_decay", "beta1", "beta2", "eps", "momentum")
STEP_FIELDS = ("clip_grad", "grad_norm_skip_threshold")
FIELDS = GROUP_FIELDS + tuple(f for f in STEP_FIELDS if f not in GROUP_FIELDS)


def group_values(group: dict) -> tuple[float, ...]:
    """The floats of ``GROUP_FIELDS`` in one param group (missing fields are 0: not used by its rule)."""
    betas = group.get("betas", (0.0, 0.0))
    values = (group["lr"], group.get("weight_decay", 0.0), betas[0], betas[1], group.get("eps", 0.0),
              group.get("momentum", 0.0))
    for name, value in zip(GROUP_FIELDS, values):
        if isinstance(value, torch.Tensor):
            raise TypeError(f"param_groups[...]['{name}'] is a tensor; graphstep keeps its own device copy: "
                            f"write a Python float (e.g. group['{name}'] = float(value))")
    return tuple(float(v) for v in values)


class HyperParams:
    def __init__(self, num_groups: int, device: torch.device):
        self.num_groups = num_groups
        self.device = torch.device(device)
        dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        self.values = torch.zeros(num_groups + 1, len(FIELDS), dtype=dtype, device=self.device)
        # A pinned staging tensor makes the refresh an asynchronous copy on a GPU. A fresh one per refresh
        # (from torch's caching host allocator, which does not hand a block out again until the copy that
        # read it has finished) avoids overwriting staging memory a previous copy may still be reading.
        self._pin = self.device.type != "cpu" and torch.cuda.is_available()
        self.host: list[tuple[float, ...]] = [tuple(0.0 for _ in FIELDS)] * (num_groups + 1)

    def tensor(self, field: str, group: int | None = None) -> torch.Tensor:
        """The 0-d device tensor of ``field`` for ``group`` (None: a step-wide field)."""
        row = self.num_groups if group is None else group
        return self.values[row, FIELDS.index(field)]

    def host_value(self, field: str, group: int | None = None) -> float:
        """The float of ``field`` as of the last refresh: what a kernel that takes floats is given."""
        row = self.num_groups if group is None else group
        return self.host[row][FIELDS.index(field)]

    def refresh(self, param_groups: Sequence[dict], step_values: dict[str, float]) -> None:
        if len(param_groups) != self.num_groups:
            raise ValueError(f"{len(param_groups)} param groups, but the step was built for {self.num_groups}: "
                             "graphstep cannot take new groups after build (add params before get_optimizer)")
        rows = []
        for group in param_groups:
            rows.append(group_values(group) + (0.0,) * (len(FIELDS) - len(GROUP_FIELDS)))
        rows.append(tuple(float(step_values.get(f, 0.0)) for f in FIELDS))
        if rows == self.host:
            return  # nothing changed: skip the copy
        self.host = rows
        staging = torch.tensor(rows, dtype=self.values.dtype)
        if self._pin:
            staging = staging.pin_memory()
        self.values.copy_(staging, non_blocking=self._pin)
