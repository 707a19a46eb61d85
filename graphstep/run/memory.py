"""``opt.memory_stats()``: the bytes this rank's optimizer holds, by kind, counted from real storages.

Returns ``{"device": {kind: bytes, ..., "total": bytes}, "host": {kind: bytes, ..., "total": bytes}}``.
Device kinds, in this order:

- ``params``       the flat param buffers (every model param is a view of one);
- ``grads``        the flat grad buffers (fp32 ``main_grad`` for half params); the reduce-scatter writes
  this rank's slice of them in place, so there is no separate reduced-grad buffer;
- ``main_params``  fp32 main params kept apart from the params (half and fp8 params: this rank's shard);
  0 where the params are fp32, since those *are* the main params (counted once, under ``params``);
- one kind per optimizer state (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...): this rank's shard
  of the groups whose family keeps it (graphstep/state/state_ranges.py: Muon + Adam pays momentum over Muon's
  matrices and the two moments over the rest, not every state over every element);
- ``grad_cast``    (where present) the fp32 copy of this rank's grad shard that the update reads when
  grads are kept in a half dtype while the main params are fp32 (with CPU offload, of the device part);
- ``comm_scratch`` buffers only the collectives use: 0, as the reduce-scatter and the all-gather both
  run in place in the flat buffers (graphstep/step/stages/reduce.py, graphstep/step/stages/gather.py);
- ``fp8_scales``   (where present) the scale, inverse scale and amax history of each fp8 weight;
- ``scalars``      the step's device scalars, the hyperparameter table and the loss-scaler state;
- ``graph_pool``   (where measurable: a captured CUDA graph) the bytes reserved in the graph's private
  memory pool; omitted on the CPU replay backend and when eager, which keep no pool.

Host kinds: what ``opt.host_tensors`` (``{kind: [tensors]}``, empty unless something such as an offload
moved state to host memory) lists, by its kinds.

Counting: each storage counts once, whole (``untyped_storage().nbytes()``), under the first kind above
that holds it; a view of a storage already counted adds nothing. So fp32 main params that are views of
the param buffer count under ``params`` only, and a storage listed in ``host_tensors`` counts under host
only. Not counted: the few small per-step work tensors stages keep (the grad norm's row norms: 4 bytes
per 4,096 grads; the folded norm's copy of the grads too short for a row: 0.1% of them at GPT-2 small),
the user's model outside the optimizer's buffers, and the allocator's own slack.

Per rank, with the distributed optimizer over N ranks and P params, this is ZeRO's accounting (the ZeRO
paper, Rajbhandari et al. 2020, §3): fp32 Adam 4P (params) + 4P (grads) + 8P/N (moments); bf16/fp16 Adam 2P
+ 4P (fp32 main grads; 2P with half grads) + 12P/N (main params and moments); SGD with momentum 4P/N of
state instead of 8P/N; families mixed, each state over its own families' elements; plus the buckets' padding
(at most lcm(N, 128) elements per bucket and 64 per param) and the scalars.
``tests/distributed/test_memory_stats.py`` checks it.
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
    """See the module docstring: ``domains`` (graphstep/step/domains.py: dense, then MoE expert params),
    ``host_tensors`` by kind, the step's device ``scalars``, and the captured graph's pool (None where not
    measurable). Host-side bookkeeping only."""
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
