"""StaticBuffers: a Layout allocated once (``allocate``, graphstep/state/allocation.py), the model's params and
grads rebound to views of it.

After ``allocate`` nothing here is ever replaced (docs/design.md law 2): ``zero_grad`` zeroes in place and
checkpoint loading copies in place, so a captured step can keep reading the same addresses forever. What a user
replaces between steps (a param's tensor, a grad, a buffer in its list) is taken back in place before the next
step (``readopt_params``, ``bind_grads``, ``restore_replaced_buffers``).

Per rank the buffers hold ZeRO's memory exactly: params + grads + the state shards (+ fp32 main shards for half
or fp8 params); ``graphstep.run.memory`` counts it. ``StaticBuffers`` says what each buffer holds.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..native import param_checks
from ..plan.layout import Layout
from ..fp8 import is_fp8
from ..fp8.engine_support import main_values
from .shard_parts import ShardParts

_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


@dataclass
class StaticBuffers(ShardParts):
    """One entry per buffer key (param dtype, grad dtype) of the layout in each list below.

    A rank's shard of a buffer is the concatenation of its shards of the buffer's buckets, which are not
    contiguous in ``param_flat``/``grad_flat``: layout.py's ``shard_start`` coordinates address the compact
    shard (shard_parts.py reads and writes a kind's values by them), ``flat_start`` the flat buffer. With hybrid
    CPU offload (graphstep.offload) the device holds main params (where they are not the params) and state only
    for a prefix ``[0, device_numel)`` of the rank's shard; the rest lives in ``host`` (``HostShards``).
    ``shard_part``, ``full_shard`` and ``load_shard`` address the whole shard wherever its elements live."""

    layout: Layout
    rank: int
    param_flat: list[torch.Tensor]
    """In the model's dtype: every model param is a view of it."""
    grad_flat: list[torch.Tensor]
    """In the grad dtype. A param's ``.grad`` is a view of it when grads accumulate in the param's dtype; else
    backward accumulates into an fp32 view ``param.main_grad`` through the param's post-accumulate-grad hook
    (``listen_for_main_grads``: the first stage of graphstep/hooks/param_hooks.py)."""
    main_shard: list[torch.Tensor]
    """fp32 main params: where the params are fp32 already, ``param_flat`` itself (at any data-parallel size:
    the update writes this rank's shard of the params in place, no second copy, no copy-back); else a separate
    fp32 tensor of this rank's shard. Address a range of it with ``main_range`` (shard coordinates), which maps
    into ``param_flat`` for the former."""
    grad_shard: list[torch.Tensor]
    """The grads of this rank's shard, reduced (what the norm and the update read): with one rank ``grad_flat``
    itself, one entry per buffer; with several, one entry per *bucket*: the view
    ``grad_flat[bucket.shard_range(rank)]`` that the bucket's reduce-scatter writes in place (its output is its
    input's own slice, which gloo and NCCL accept; no separate output buffer). So after a step with several
    ranks a grad holds the averaged grads in this rank's shard ranges and the local ones elsewhere:
    ``zero_grad`` before the next backward (as with Megatron-Core's grad buffers)."""
    state: dict[str, list[torch.Tensor]]
    """Optimizer state shards by name (``exp_avg``, ``exp_avg_sq`` or ``momentum_buffer``), each over only the
    groups whose family keeps it (``state_ranges``, graphstep/state/state_ranges.py): address a range of it
    with ``shard_part`` (shard coordinates) after asking ``keeps_state``."""
    params: list[torch.nn.Parameter]  # in layout (input) order
    _main_grads: list = field(default_factory=list)  # each param's main_grad view, kept for identity checks
    _param_ptrs: Any = None  # each param view's data pointer, as graphstep.native.param_checks takes them
    _bound_grads: list = field(default_factory=list)
    """Per param, its ``grad_flat`` view where its ``.grad`` is one (one object each, kept for identity checks),
    else None: grads that accumulate into an fp32 main grad."""
    _param_keys: list = field(default_factory=list)  # (data_ptr, dtype, shape) per param view
    _seen_bound: bool = False  # ``bound_and_requiring_grad``'s verdict, kept for one ``bindings_intact``
    _originals: dict = field(default_factory=dict)
    host: Optional[Any] = None  # graphstep.offload.HostShards: the shard's host part, or None
    grads_taken_at_build: int = 0  # params whose grad, left by a backward before the build, is in grad_flat
    state_ranges: dict = field(default_factory=dict)  # name -> StateRanges: where each state buffer keeps its elements
    stored: dict = field(default_factory=dict)
    """kind -> per buffer, the ``StoredState`` of a state, or of the main params ("main"; None for a buffer
    whose main params are not), kept below fp32 with the precision-aware optimizer (graphstep/state/precision.py).
    Their tensors hold encoded bytes (a scaled fp16/fp8 moment, an int16 remainder in ``main_shard``): read and
    write their values through ``read_part`` / ``write_part``, ``full_shard`` / ``load_shard``, never the raw
    bytes."""
    scratch: dict = field(default_factory=dict)
    """Static tensors stages allocate at build, by kind (e.g. "grad_cast"), listed for ``graphstep.run.memory``."""

    def record_bindings(self) -> None:
        """Remember what every param, grad and buffer slot points at now (right after allocation)."""
        views = [self.param_view(i) for i in range(len(self.params))]
        self._param_ptrs = param_checks.int64s(view.data_ptr() for view in views)
        self._param_keys = [(view.data_ptr(), view.dtype, view.shape) for view in views]
        self._bound_grads = [self.grad_view(i) if self.grads_in_param_dtype(i) else None
                             for i in range(len(self.params))]
        self._originals = {(kind, b): t for kind, tensors in self._slots() for b, t in enumerate(tensors)}

    def _slots(self):
        yield from (("param_flat", self.param_flat), ("grad_flat", self.grad_flat),
                    ("main_shard", self.main_shard), ("grad_shard", self.grad_shard))
        yield from self.state.items()

    def bindings_intact(self) -> bool:
        """One cheap pass per step: every param still a view of ``param_flat``, every grad of ``grad_flat``
        (the data pointers, and the grad objects by identity: a grad assigned by ``bind_grads`` stays the very
        same Python object while backward accumulates into it), in graphstep/native/param_checks.py's loops.
        Answered without a pass where ``bound_and_requiring_grad`` found them bound in the same run of the
        pre-step checks (graphstep/pre_step.py)."""
        if self._seen_bound:
            self._seen_bound = False
            return True
        return param_checks.first_unbound(self.params, data_ptrs=self._param_ptrs, grads=self._bound_grads) < 0

    def bound_and_requiring_grad(self) -> bool:
        """``bindings_intact``'s pass that also reads each param's ``requires_grad`` (True for all): the
        requires_grad watch's read of these params (hooks/requires_grad_watch.py), in the same visit of each
        param. True is kept for the next ``bindings_intact`` until ``forget_seen_bound``."""
        self._seen_bound = param_checks.first_unbound(self.params, data_ptrs=self._param_ptrs,
                                                      grads=self._bound_grads, requires_grad=True) < 0
        return self._seen_bound

    def forget_seen_bound(self) -> None:
        """End of a run of the pre-step checks: a verdict of its reads says nothing about the next one's."""
        self._seen_bound = False

    def restore_replaced_buffers(self) -> list[str]:
        """Copy the values of any buffer or state tensor that was replaced in its list (e.g. a checkpoint
        loaded by assignment) into the original static tensor and put that back. Returns their names."""
        restored = []
        for kind, tensors in self._slots():
            for b, tensor in enumerate(tensors):
                original = self._originals[(kind, b)]
                if tensor is not original:
                    if tensor.shape != original.shape:
                        raise ValueError(f"{kind}[{b}] was replaced by a tensor of shape {tuple(tensor.shape)}, "
                                         f"not {tuple(original.shape)}")
                    original.copy_(tensor)
                    tensors[b] = original
                    restored.append(f"{kind}[{b}]")
        return restored

    def param_view(self, index: int) -> torch.Tensor:
        place = self.layout.params[index]
        return self.param_flat[place.buffer][place.start:place.end].view(place.shape)

    def grad_view(self, index: int) -> torch.Tensor:
        place = self.layout.params[index]
        return self.grad_flat[place.buffer][place.start:place.end].view(place.shape)

    def grads_in_param_dtype(self, index: int) -> bool:
        return self.grad_flat[self.layout.params[index].buffer].dtype == self.params[index].dtype

    def owns(self, index: int, param: torch.nn.Parameter) -> bool:
        """Whether ``param`` (param ``index``) is still laid out in these buffers: an optimizer built later over
        the same model gives it a main_grad of its own, and this one's grad listeners must then leave it alone
        (graphstep/hooks/param_hooks.py checks it before them)."""
        return getattr(param, "main_grad", None) is self._main_grads[index]

    def listen_for_main_grads(self, hooks) -> None:
        """Have ``hooks`` (graphstep.hooks.param_hooks.GradHooks) accumulate into the fp32 main grad of every param
        whose grads are not in its own dtype (fp8 params' backward writes ``main_grad`` itself)."""
        for i, p in enumerate(self.params):
            if not self.grads_in_param_dtype(i) and not is_fp8(p):
                hooks.listen("main_grad", self, i, self, "accumulate_into_main_grad", i)

    def accumulate_into_main_grad(self, index: int, param: torch.nn.Parameter) -> None:
        """Param ``index``'s listener (stage "main_grad"), called only while these buffers own the param."""
        # Backward has just written this micro-batch's grad in the param's (half) dtype; fold it into the fp32
        # main grad and drop it, so the next micro-batch starts a fresh half grad and accumulation is in fp32.
        param.main_grad.add_(param.grad)
        param.grad = None

    def grad_bound(self, index: int) -> bool:
        """Whether param ``index``'s ``.grad`` is its ``grad_flat`` view (always, for grads that accumulate into
        an fp32 main grad: their ``.grad`` is None between backwards by design)."""
        view = self._bound_grads[index]
        return view is None or self.params[index].grad is view

    def adopt_grad(self, index: int, param: torch.nn.Parameter) -> None:
        """From a backward hook: a grad autograd made afresh (the user had set it to None) moves into its
        ``grad_flat`` view, as ``bind_grads`` would before the step, so that what reads the view now (a
        reduce-scatter, a folded norm) reads this backward's grad."""
        view = self._bound_grads[index]  # the very object bindings_intact checks for
        if view is not None and param.grad is not None:  # None view: grads accumulate into an fp32 main grad
            _rebind_grad(param, view)

    def bind_grads(self) -> None:
        """Point every param's grad back at its ``grad_flat`` view, keeping any values written elsewhere.

        Cheap host-side work, run before each step: a user's ``model.zero_grad()`` (set_to_none) or a
        ``p.grad = ...`` assignment must not make the step read stale memory. A grad set to None means
        "no grad": its view is zeroed, so the step applies exactly what a zero grad would. (Params whose
        grads accumulate into an fp32 ``main_grad`` are left alone: their ``.grad`` is None between
        backwards by design, and only ``opt.zero_grad()`` clears ``main_grad``.)
        """
        zeroed, copied_into, copied_from = [], [], []  # one foreach op each, however many params
        for p, view in zip(self.params, self._bound_grads):
            grad = p.grad
            if view is None or grad is view:
                continue
            if grad is None:
                zeroed.append(view)
            elif grad.data_ptr() != view.data_ptr():
                copied_into.append(view)
                copied_from.append(grad)
            p.grad = view
        if zeroed:
            torch._foreach_zero_(zeroed)
        if copied_into:
            torch._foreach_copy_(copied_into, copied_from)

    def readopt_params(self) -> list[str]:
        """Take back params whose tensor was replaced (``p.data = new``): copy the new values into the flat
        buffer and this rank's main params, then make the param a view again. Returns their names."""
        adopted = []
        now = zip(map(torch.Tensor.data_ptr, self.params), map(_DTYPE, self.params), map(_SHAPE, self.params))
        replaced = [i for i, (key, bound) in enumerate(zip(now, self._param_keys)) if key != bound]
        for i in replaced:  # all refusals before any copy: a refused step changes nothing
            p, place = self.params[i], self.layout.params[i]
            if tuple(p.shape) != place.shape:
                raise ValueError(f"param '{place.name}' was replaced by a tensor of shape {tuple(p.shape)}, "
                                 f"not {place.shape}: build a new optimizer for a new model")
            refuse_conversion(place.name, p, self.param_view(i))
        for i in replaced:
            p, view, place = self.params[i], self.param_view(i), self.layout.params[i]
            values = p.detach()
            view.copy_(values)
            if not self.main_is_param[place.buffer] or self.host is not None:
                for owned in self.layout.owned_ranges(self.rank):
                    if owned.param == i:
                        size = owned.param_end - owned.param_start
                        self.shard_part("main", place.buffer, owned.shard_start, size).copy_(
                            main_values(p, values).reshape(-1)[owned.param_start:owned.param_end])
            p.data = view
            adopted.append(f"param '{place.name}'")
        self.bind_grads()
        return adopted

    def zero_grad(self) -> None:
        for grad in self.grad_flat:  # every grad_shard entry is a view of these
            grad.zero_()
        self.bind_grads()

    def addresses(self) -> dict[str, torch.Tensor]:
        """Every static buffer by name: what a capture guards before each replay. (Params are checked by
        ``bindings_intact`` instead, in one pass with the grads.)"""
        named = {}
        for kind in ("param_flat", "grad_flat", "main_shard", "grad_shard"):
            for b, tensor in enumerate(getattr(self, kind)):
                named[f"{kind}[{b}]"] = tensor
        for name, tensors in self.state.items():
            for b, tensor in enumerate(tensors):
                named[f"{name}[{b}]"] = tensor
        return named


def refuse_conversion(name: str, now: torch.Tensor, bound: torch.Tensor) -> None:
    """Raise if a param replaced since the build (``now``) is on another device or of another dtype than its
    flat-buffer view ``bound`` (``model.to(...)``, ``.half()`` after ``get_optimizer``): taking it back would
    quietly move or cast the user's model back to what the buffers hold."""
    if now.device != bound.device:
        change = f"moved to {now.device}, but the optimizer's buffers are on {bound.device}"
    elif now.dtype != bound.dtype:
        change = f"cast to {now.dtype}, but the optimizer keeps it in {bound.dtype}"
    else:
        return
    raise ValueError(f"param '{name}' was {change} after get_optimizer (model.to(...), .half(), ...); the step "
                     "would put it back. Move or cast the model before building the optimizer (OptimizerConfig's "
                     "bf16/fp16 cast the params for you)")


def _rebind_grad(param: torch.nn.Parameter, view: torch.Tensor) -> None:
    """Make ``view`` the param's (non-None) grad again, moving the grad's values into it unless they are
    already there."""
    if param.grad is not view:
        if param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
        param.grad = view
