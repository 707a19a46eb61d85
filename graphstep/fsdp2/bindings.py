"""FSDP2's tensors pointed at graphstep's flat buffers, and kept there (docs/fsdp2-notes.md §1–2).

After ``allocate`` each ``LocalShard.local`` is a view of the flat param buffer holding this rank's padded chunk.
``bind`` makes FSDP2 read and write there:

- ``FSDPParam._sharded_param_data`` (what its all-gather reads) is that view, flat, and the DTensor param's local
  tensor its real rows: an in-place update of the flat buffer is what the next forward gathers;
- the DTensor param's ``.grad`` is set ahead of backward, over the real rows of the param's flat grad view:
  FSDP2 then accumulates its reduce-scattered grad into it in place (``grad._local_tensor += ...``) instead of
  handing out a fresh tensor, so the step reads the grads where they landed.

``check`` runs before every step (its passes: graphstep/native/param_checks.py): a grad FSDP2 or the user
replaced (``set_to_none`` zeroing, a ``p.grad = ...``) is copied in (None: zeros) and the prepared one set back;
a param whose sharded data FSDP2 moved (``model.to(...)``, a ``load_state_dict`` into another storage) has its
values copied in and is bound again. The buffers' addresses never change, so a captured step stays valid.
"""

from __future__ import annotations

import operator

from ..native import param_checks
from ..state.buffers import refuse_conversion
from .shards import LocalShard

_SHARDED_DATA = "_sharded_param_data"  # of an FSDPParam: what its all-gather reads
_LOCAL = "_local_tensor"  # of a DTensor param


class FsdpBindings:
    def __init__(self, shards: list[LocalShard], buffers):
        """``buffers``: the engine's ``StaticBuffers`` laid out over ``[s.local for s in shards]``, in order."""
        if [id(p) for p in buffers.params] != [id(s.local) for s in shards]:
            raise ValueError("graphstep: the FSDP2 local shards and the flat buffers disagree on the params")
        self.shards = shards
        self._params, self._fsdp_params = [s.param for s in shards], [s.fsdp_param for s in shards]
        self._views = [buffers.param_view(i) for i in range(len(shards))]
        self._grad_views = [buffers.grad_view(i) for i in range(len(shards))]
        self._grads = [s.fsdp_param.to_sharded_dtensor(s.real_rows(g)) for s, g in zip(shards, self._grad_views)]
        self._data_ptrs = param_checks.int64s(view.data_ptr() for view in self._views)
        self.grads_taken_at_build = 0  # grads a backward left before the build: copied into the flat grads
        for i in range(len(shards)):
            self._bind_param(i)
            grad = shards[i].param.grad
            self.grads_taken_at_build += grad is not None
            self.restore_grad(i, grad)

    def _bind_param(self, i: int) -> None:
        shard, view = self.shards[i], self._views[i]
        shard.fsdp_param._sharded_param_data = view.view(-1)
        shard.param._local_tensor = shard.real_rows(view)

    def _moved(self) -> list[int]:
        """The params whose sharded data or local tensor is no longer their view of the flat buffer."""
        ptrs = self._data_ptrs
        if (param_checks.first_unbound(self._fsdp_params, data_ptrs=ptrs, attribute=_SHARDED_DATA) < 0
                and param_checks.first_unbound(self._params, data_ptrs=ptrs, attribute=_LOCAL) < 0):
            return []
        sharded = list(map(operator.attrgetter(_SHARDED_DATA), self._fsdp_params))
        local = list(map(operator.attrgetter(_LOCAL), self._params))
        return [i for i, (a, b, bound) in enumerate(zip(sharded, local, self._data_ptrs))
                if a.data_ptr() != bound or b.data_ptr() != bound]

    def check(self) -> None:
        """Copy in and re-bind what was replaced since the last step (a param moved to another device or cast
        to another dtype is refused first: nothing changes then)."""
        moved = self._moved()
        for i in moved:
            refuse_conversion(self.shards[i].name, self.shards[i].param._local_tensor, self._views[i])
        for i in moved:
            shard = self.shards[i]
            shard.real_rows(self._views[i]).copy_(shard.param._local_tensor)  # FSDP2's own: the real rows
            self._bind_param(i)
        if param_checks.first_unbound(self._params, grads=self._grads) < 0:  # the DTensor's own grad attribute
            return
        for i, shard in enumerate(self.shards):
            grad = shard.param.grad
            if grad is not self._grads[i]:
                self.restore_grad(i, grad)

    def restore_grad(self, i: int, grad) -> None:
        view = self.shards[i].real_rows(self._grad_views[i])
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad._local_tensor if hasattr(grad, "_local_tensor") else grad)
        self.shards[i].param.grad = self._grads[i]

    def rebind_grads(self) -> None:
        """After ``zero_grad``: grads a user set to None point at the (zeroed) flat grads again."""
        for i, shard in enumerate(self.shards):
            if shard.param.grad is not self._grads[i]:
                self.restore_grad(i, None)
