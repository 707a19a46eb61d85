"""HostShards: the host part of this rank's shard, in flat host buffers allocated once.

Per flat buffer: fp32 main params, optimizer state, fp32 grads (written by the device step's D2H copy), the
model-dtype staging of the updated params for the H2D copy (none for fp32 params), and the step's scalars and
hyperparameters as host tensors. Grads, main params, staging and scalars are pinned where torch has an
accelerator, so the copies are asynchronous; a CPU-only torch refuses pinned memory, and there nothing is pinned.
"""

from __future__ import annotations

from typing import Optional

import torch

from capture.devices import accelerator_available

from ..plan.layout import Layout
from ..state.hyperparams import FIELDS, scalar_dtype
from .plan import OffloadPlan

HOST = torch.device("cpu")


def _empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=HOST, pin_memory=pin and numel > 0)


class HostShards:
    def __init__(self, plan: OffloadPlan, layout: Layout, *, main_dtype: torch.dtype, state_names, num_groups: int,
                 device: torch.device, pin_grads: bool, pin_params: bool):
        self.plan = plan
        self.splits = plan.splits
        can_pin = torch.device(device).type != "cpu" and accelerator_available()
        self.pinned_grads = pin_grads and can_pin
        self.pinned_params = pin_params and can_pin
        sizes = [plan.host_size(b) for b in range(len(layout.buffers))]
        self.main = [_empty(n, main_dtype, self.pinned_params) for n in sizes]
        self.state = {name: [_empty(n, main_dtype, False) for n in sizes] for name in state_names}
        self.grads = [_empty(n, main_dtype, self.pinned_grads) for n in sizes]
        self.staging: list[Optional[torch.Tensor]] = [
            None if buf.param_dtype == main_dtype else _empty(n, buf.param_dtype, self.pinned_params)
            for n, buf in zip(sizes, layout.buffers)]
        scalars_pinned = can_pin

        def scalar(value=0.0):
            return torch.full((), value, dtype=torch.float32, pin_memory=scalars_pinned)

        self.step, self.grad_scale, self.found_inf = scalar(), scalar(1.0), scalar()
        self.hyper = torch.zeros(num_groups + 1, len(FIELDS), dtype=scalar_dtype(HOST))
        self._hyper_rows: list = []

    def part(self, kind: str, buffer: int) -> torch.Tensor:
        """The host buffer of ``kind`` ("main" or a state name) for flat buffer ``buffer``."""
        return self.main[buffer] if kind == "main" else self.state[kind][buffer]

    def params_source(self, buffer: int) -> torch.Tensor:
        """What the H2D copy of ``buffer``'s host part reads: the staging copy, or the fp32 main params."""
        staging = self.staging[buffer]
        return self.main[buffer] if staging is None else staging

    def refresh_hyper(self, host_rows: list) -> None:
        """Copy the hyperparameters of the last refresh (``HyperParams.host_rows``) into ``hyper``."""
        if host_rows != self._hyper_rows:
            self.hyper.copy_(torch.tensor(host_rows, dtype=self.hyper.dtype))
            self._hyper_rows = list(host_rows)

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every host buffer by kind (``GraphstepOptimizer.host_tensors``, read by ``memory_stats``)."""
        named = {"main_params": list(self.main), **{name: list(t) for name, t in self.state.items()},
                 "grads": list(self.grads), "param_staging": [t for t in self.staging if t is not None],
                 "scalars": [self.step, self.grad_scale, self.found_inf, self.hyper]}
        return {kind: tensors for kind, tensors in named.items() if tensors}
