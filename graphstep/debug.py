"""The debugging step: the same stage functions, run one at a time, with host-read stats.

``opt.debug_step()`` syncs after each stage to time it and read the step's scalars, and finds where a
non-finite value first appeared: which param, which tensor (grad, param, main param, optimizer state)
and after which stage ("backward" when the grads arrived that way). Everything here reads device values
on the host on purpose; none of it is part of the step that ``step()`` runs or a capture records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from capture.devices import synchronize

SCALARS = ("nonfinite", "found_inf", "grad_norm", "clip_coef", "grad_scale", "loss_scale", "step")


@dataclass(frozen=True)
class StageStats:
    name: str
    ms: float
    scalars: dict  # the step's scalars after this stage, as floats


@dataclass(frozen=True)
class NanOrigin:
    stage: str  # "backward" when the grads were non-finite before the step began
    param: str
    tensor: str  # "grad", "param", "main_param" or a state name such as "exp_avg"

    def __str__(self) -> str:
        return f"first non-finite value: {self.tensor} of '{self.param}' (after {self.stage})"


@dataclass(frozen=True)
class StepReport:
    stages: tuple[StageStats, ...]
    nan_origin: Optional[NanOrigin]
    update_successful: bool

    def table(self) -> str:
        """The per-stage stats as a fixed-width text table."""
        header = f"{'stage':<10} {'ms':>8} " + " ".join(f"{s:>12}" for s in SCALARS)
        rows = [header] + [f"{st.name:<10} {st.ms:>8.3f} " + " ".join(f"{st.scalars[s]:>12.5g}" for s in SCALARS)
                           for st in self.stages]
        if self.nan_origin is not None:
            rows.append(str(self.nan_origin))
        return "\n".join(rows)


def _first_non_finite(opt, stage: str, *, grads_only: bool) -> Optional[NanOrigin]:
    domains = [(opt.buffers, opt.layout, opt.rank)]
    if getattr(opt, "experts", None) is not None:  # MoE expert params (graphstep/experts.py): their own buffers
        domains.append((opt.experts.buffers, opt.experts.layout, opt.experts.ctx.rank))
    for buffers, layout, rank in domains:
        origin = _first_in_domain(buffers, layout, rank, stage, grads_only)
        if origin is not None:
            return origin
    return None


def _first_in_domain(buffers, layout, rank: int, stage: str, grads_only: bool) -> Optional[NanOrigin]:
    owned = {r.param: r for r in layout.owned_ranges(rank)}
    for i, place in enumerate(layout.params):
        views = [("grad", buffers.grad_view(i))]
        if not grads_only:
            views.append(("param", buffers.param_view(i)))
            r = owned.get(i)
            if r is not None:
                size = r.param_end - r.param_start
                if not buffers.main_is_param[place.buffer] or buffers.host is not None:
                    views.append(("main_param", buffers.shard_part("main", place.buffer, r.shard_start, size)))
                for name in buffers.state:
                    views.append((name, buffers.shard_part(name, place.buffer, r.shard_start, size)))
        for tensor_name, view in views:
            if view.dtype.itemsize == 1:  # fp8 weights: isfinite has no fp8 kernel; the fp32 copy is exact
                view = view.float()
            if not bool(torch.isfinite(view).all()):  # host read: this is the debugger
                return NanOrigin(stage, place.name, tensor_name)
    return None


def run_debug_step(opt) -> StepReport:
    origin = _first_non_finite(opt, "backward", grads_only=True)
    stats = []
    for stage in (*opt.stages, *opt.host_stages):  # host stages: CPU offload's host update (never captured)
        synchronize(opt.device)
        start = time.perf_counter()
        stage.apply()
        synchronize(opt.device)
        ms = (time.perf_counter() - start) * 1e3
        scalars = {name: float(getattr(opt.tensors, name)) for name in SCALARS}
        stats.append(StageStats(stage.name, ms, scalars))
        if origin is None:
            origin = _first_non_finite(opt, stage.name, grads_only=False)
    return StepReport(tuple(stats), origin, bool(opt.tensors.update_successful))
