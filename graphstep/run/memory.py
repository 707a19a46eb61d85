"""``opt.memory_stats()``: the bytes this rank's optimizer holds, by kind, counted from real storages.

Counted from storages, not computed from shapes, so that what is reported is what is held: each storage counts
once, whole, under the first kind that holds it (fp32 main params that are views of the param buffer count under
``params`` only). Not counted: the stages' few small work tensors, the user's model outside the optimizer's
buffers and the allocator's slack. Per rank this is ZeRO's accounting (Rajbhandari et al. 2020, §3), plus the
buckets' padding and the scalars; tests/distributed/test_memory_stats.py checks it.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch


def _storage_key(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return (tensor.device.type, tensor.device.index, storage.data_ptr(), storage.nbytes())


class _Ledger:
    """Bytes per kind, each storage counted once under the first kind that claims it."""

    def __init__(self, seen: Optional[set] = None):
        self.kinds: dict[str, int] = {}
        self.seen = set() if seen is None else seen

    def add(self, kind: str, tensors: Iterable[torch.Tensor]) -> None:
        total = self.kinds.get(kind, 0)
        for tensor in tensors:
            key = _storage_key(tensor)
            if key not in self.seen:
                self.seen.add(key)
                total += key[3]
        self.kinds[kind] = total

    def result(self) -> dict[str, int]:
        return {**self.kinds, "total": sum(self.kinds.values())}


def memory_stats(domains, host_tensors: dict, scalars: list, graph_pool_bytes: Optional[int]
                 ) -> dict[str, dict[str, int]]:
    """``{"device": {kind: bytes, ..., "total": bytes}, "host": {kind: bytes, ..., "total": bytes}}``.

    Device kinds, in this order: ``params``, ``grads`` (the reduce-scatter writes in place: no reduced-grad
    buffer), ``main_params`` (0 where the params are fp32: they *are* the main params), one kind per optimizer
    state (this rank's shard of the groups whose family keeps it), ``grad_cast`` (where present), ``comm_scratch``
    (0: the collectives run in place), ``fp8_scales`` (where present), ``scalars``, and ``graph_pool`` (a captured
    CUDA graph's pool, where measurable). Host kinds: those of ``host_tensors``.

    ``domains``: graphstep/step/domains.py (dense, then MoE expert params); ``scalars``: the step's device
    scalars; ``graph_pool_bytes``: None where not measurable. Host-side bookkeeping only."""
    host = _Ledger()
    for kind, tensors in host_tensors.items():
        host.add(kind, tensors)
    device = _Ledger(seen=set(host.seen))  # a storage listed as host memory is not device memory
    buffers_by_domain = [domain.buffers for domain in domains]
    for buffers in buffers_by_domain:
        device.add("params", buffers.param_flat)
        device.add("grads", buffers.grad_flat)
        device.add("grads", buffers.grad_shard)  # views of grad_flat: adds nothing (asserted by the tests)
        device.add("main_params", buffers.main_shard)
        for name, tensors in buffers.state.items():
            device.add(name, tensors)
        for kind, per_buffer in buffers.stored.items():  # kept below fp32: the scales and piece bounds
            device.add("main_params" if kind == "main" else kind,
                       [t for s in per_buffer if s is not None for t in (s.scales, s.positions) if t is not None])
        for name, tensors in buffers.scratch.items():
            device.add(name, tensors)
    device.add("comm_scratch", [])
    fp8_metas = [p.fp8_meta for b in buffers_by_domain for p in b.params if getattr(p, "fp8_meta", None) is not None]
    if fp8_metas:
        device.add("fp8_scales", [t for m in fp8_metas for t in (m.scale, m.scale_inv, m.amax_history)])
    device.add("scalars", scalars)
    if graph_pool_bytes is not None:
        device.kinds["graph_pool"] = graph_pool_bytes
    return {"device": device.result(), "host": host.result()}


def memory_stats_by_kind(device_tensors: dict[str, list], graph_pool_bytes: Optional[int]) -> dict[str, dict[str, int]]:
    """The same count over device tensors listed by kind (``graphstep.wrap``'s optimizer: its params, grads and
    state), each storage once, under the first kind that lists it; no host memory."""
    device = _Ledger()
    for kind, tensors in device_tensors.items():
        device.add(kind, tensors)
    if graph_pool_bytes is not None:
        device.kinds["graph_pool"] = graph_pool_bytes
    return {"device": device.result(), "host": _Ledger().result()}
