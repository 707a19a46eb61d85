"""Device tensors for everything a schedule may change, refreshed from ``param_groups`` before each step.

A Python float read inside the step would be baked into a captured graph forever (docs/design.md law 3), so the
step reads these tensors; ``refresh`` copies the groups' floats in with one small host-to-device copy, outside
the graph. One ``values`` table (a row per group, the last row step-wide; columns from
``graphstep.families.hyper_columns``), each hyperparameter a 0-d view of it, so no address ever changes. dtype:
float64 on the CPU, where an fp64 lr makes the fused kernel bitwise ``torch.optim.AdamW(fused=True)``; float32
elsewhere. A refresh refuses a non-finite value, naming the group and field: a NaN lr would turn every param NaN.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from capture.devices import accelerator_available

from ..families import hyper_columns

_GROUP_COLUMNS = hyper_columns()
GROUP_FIELDS = tuple(column.column for column in _GROUP_COLUMNS)
STEP_FIELDS = ("clip_grad", "grad_norm_skip_threshold")
FIELDS = GROUP_FIELDS + STEP_FIELDS
_COLUMN = {field: i for i, field in enumerate(FIELDS)}
# Fields that may be +inf ("never"): the skip threshold's default.
_MAY_BE_INFINITE = frozenset({"grad_norm_skip_threshold"})


def scalar_dtype(device) -> torch.dtype:
    """The dtype of hyperparameter tensors on ``device`` (see the module docstring)."""
    return torch.float64 if torch.device(device).type == "cpu" else torch.float32


def group_values(group: dict) -> tuple[float, ...]:
    """The floats of ``GROUP_FIELDS`` in one param group (missing fields are 0: not used by its rule)."""
    values = tuple(column.read(group) for column in _GROUP_COLUMNS)
    for name, value in zip(GROUP_FIELDS, values):
        if isinstance(value, torch.Tensor):
            raise TypeError(f"param_groups[...]['{name}'] is a tensor; graphstep keeps its own device copy: "
                            f"write a Python float (e.g. group['{name}'] = float(value))")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"param_groups[...]['{name}'] = {value!r}: must be a number")
    return tuple(float(v) for v in values)


def _check_finite(rows: list[tuple[float, ...]]) -> None:
    for r, row in enumerate(rows):
        where = "the step" if r == len(rows) - 1 else f"param group {r}"
        for field, value in zip(FIELDS, row):
            if math.isnan(value) or (math.isinf(value) and field not in _MAY_BE_INFINITE):
                raise ValueError(f"graphstep: {field}={value} in {where} is not finite; a schedule or an "
                                 "assignment between steps set it. Set a finite value before the next step")
    clip = rows[-1][_COLUMN["clip_grad"]]
    if clip < 0:
        raise ValueError(f"graphstep: clip_grad={clip} is negative; use 0 to turn clipping off")


class HyperParams:
    def __init__(self, num_groups: int, device: torch.device):
        self.num_groups = num_groups
        self.device = torch.device(device)
        self.values = torch.zeros(num_groups + 1, len(FIELDS), dtype=scalar_dtype(self.device), device=self.device)
        # A pinned staging tensor makes the refresh an asynchronous copy on a GPU. A fresh one per refresh
        # (from torch's caching host allocator, which does not hand a block out again until the copy that
        # read it has finished) avoids overwriting staging memory a previous copy may still be reading.
        self._pin = self.device.type != "cpu" and accelerator_available()
        self.host_rows: list[tuple[float, ...]] = [tuple(0.0 for _ in FIELDS)] * (num_groups + 1)

    def position(self, field: str, group: int | None = None) -> tuple[int, int]:
        """(row, column) of ``field`` for ``group`` (None: a step-wide field) in ``values``/``host_rows``."""
        return (self.num_groups if group is None else group), _COLUMN[field]

    def tensor(self, field: str, group: int | None = None) -> torch.Tensor:
        """The 0-d device tensor of ``field`` for ``group`` (None: a step-wide field)."""
        return self.values[self.position(field, group)]

    def host_value(self, field: str, group: int | None = None) -> float:
        """The float of ``field`` as of the last refresh."""
        row, column = self.position(field, group)
        return self.host_rows[row][column]

    def refresh(self, param_groups: Sequence[dict], step_values: dict[str, float]) -> None:
        if len(param_groups) != self.num_groups:
            raise ValueError(f"{len(param_groups)} param groups, but the step was built for {self.num_groups}: "
                             "graphstep cannot take new groups after build (add params before get_optimizer)")
        rows = [group_values(group) + (0.0,) * len(STEP_FIELDS) for group in param_groups]
        rows.append((0.0,) * len(GROUP_FIELDS) + tuple(float(step_values[f]) for f in STEP_FIELDS))
        if rows == self.host_rows:
            return  # nothing changed: skip the copy
        _check_finite(rows)
        self.host_rows[:] = rows
        staging = torch.tensor(rows, dtype=self.values.dtype)
        if self._pin:
            staging = staging.pin_memory()
        self.values.copy_(staging, non_blocking=self._pin)
