"""The debugging step: the same stage functions, run one at a time, with host-read stats.

``opt.debug_step()`` syncs after each stage to time it and read the step's scalars, and finds where a
non-finite value first appeared: which param, which tensor and after which stage. Everything here reads device
values on the host on purpose; none of it is part of the step that ``step()`` runs or a capture records. Given
a closure, ``trace_closure`` hooks every module to name the first one that made a non-finite value from finite
ones, in forward or backward. Backward is traced with tensor hooks on views of each input, not full backward
hooks (which break modules that change an input in place) nor anomaly mode (which stops the backward at the
first NaN, leaving a half-accumulated grad for the step).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Optional

import torch

from capture.devices import synchronize

SCALARS = ("nonfinite", "found_inf", "grad_norm", "clip_coef", "grad_scale", "loss_scale", "step")
_MAX_DEPTH = 6  # how deep the hooks look into nested containers a module takes or returns


@dataclass(frozen=True)
class StageStats:
    name: str
    ms: float
    scalars: dict  # the step's scalars after this stage, as floats


@dataclass(frozen=True)
class ModuleSource:
    """The first module of the model that made a non-finite value from finite ones, while the closure ran."""
    module: str  # qualified name as named_modules() gives it ('' is the model itself); chunk index first with
    #              several chunks, as in param names
    module_type: str  # the module's class name, e.g. "Linear"
    phase: str  # "forward" or "backward"
    what: str  # "output", "param 'weight'", "grad of its input" or "grad of its param 'weight'"
    own_code: bool  # a module with submodules whose submodules' values were finite: its own code made it

    def describe(self) -> str:
        name = f"module '{self.module}'" if self.module else "the model's top module"
        where = f"{self.what} of {name} ({self.module_type}) in {self.phase}"
        return where + (" (made by its own code: its submodules' values were finite)" if self.own_code else "")


@dataclass(frozen=True)
class ClosureTrace:
    """What the hooks saw while ``debug_step(closure)`` ran the closure."""
    source: Optional[ModuleSource]  # None: no module made a non-finite value from finite ones
    modules: int  # how many modules were hooked (0: the model is gone, or the optimizer was given none)


@dataclass(frozen=True)
class NanOrigin:
    stage: str  # "backward" when the grads were non-finite before the step began
    param: str
    tensor: str  # "grad", "param", "main_param" or a state name such as "exp_avg"
    # Where the model made it (stage "backward" only): found when debug_step ran the closure.
    module: Optional[str] = None  # qualified module name, e.g. "blocks.1.mlp"; None when not found
    module_type: Optional[str] = None  # its class name
    phase: Optional[str] = None  # "forward" or "backward"
    source: Optional[str] = None  # the full sentence: what of which module, in which phase
    traced: bool = False  # whether the closure ran under the module hooks (debug_step(closure))

    def __str__(self) -> str:
        found = f"{self.tensor} of '{self.param}' (after {self.stage})"
        if self.stage != "backward":  # made by the step itself: the model is not involved
            return f"first non-finite value: {found}"
        if self.source is not None:
            return f"first non-finite value: {self.source}; first non-finite grad: '{self.param}'"
        if self.traced:
            return (f"first non-finite value: {found}; no module of the model made a non-finite value from finite "
                    "ones, so it came from outside them (the loss outside the model, or a write to the grads)")
        return (f"first non-finite value: {found}; the module that made it is unknown: run "
                "opt.debug_step(closure) with a closure that runs forward and backward to name it")


@dataclass(frozen=True)
class StepReport:
    stages: tuple[StageStats, ...]
    nan_origin: Optional[NanOrigin]
    update_successful: bool
    model_source: Optional[ModuleSource] = None
    """What the closure's hooks found, even where it never reached the step (a NaN loss whose grads stayed
    finite); None without a closure or when no module made a non-finite value."""

    def table(self) -> str:
        """The per-stage stats as a fixed-width text table."""
        header = f"{'stage':<10} {'ms':>8} " + " ".join(f"{s:>12}" for s in SCALARS)
        rows = [header] + [f"{st.name:<10} {st.ms:>8.3f} " + " ".join(f"{st.scalars[s]:>12.5g}" for s in SCALARS)
                           for st in self.stages]
        if self.nan_origin is not None:
            rows.append(str(self.nan_origin))
        if self.model_source is not None and (self.nan_origin is None or self.nan_origin.source is None):
            rows.append(f"non-finite value in the model that did not reach the step's grads: "
                        f"{self.model_source.describe()}")
        return "\n".join(rows)


# ---- the model's side: hooks while the closure runs -----------------------------------------------------
def _tensors(value, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every plain tensor in ``value``, through tuples, lists, dicts and dataclasses."""
    if isinstance(value, torch.Tensor):
        if type(value) in (torch.Tensor, torch.nn.Parameter):  # subclasses (DTensor, fp8 wrappers): not read
            yield value
    elif depth < _MAX_DEPTH:
        if isinstance(value, (tuple, list)):
            items = value
        elif isinstance(value, dict):
            items = value.values()
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            items = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
        else:
            return
        for item in items:
            yield from _tensors(item, depth + 1)


def _finite(t: torch.Tensor) -> bool:
    if not (t.is_floating_point() or t.is_complex()) or t.is_sparse or t.device.type == "meta":
        return True
    if t.dtype.itemsize == 1:  # fp8: isfinite has no fp8 kernel; the fp32 copy is exact
        t = t.float()
    return bool(torch.isfinite(t).all())  # host read: this is the debugger


def _all_finite(value) -> bool:
    return all(_finite(t) for t in _tensors(value))


def _grad_finite(grad) -> bool:
    """A grad a hook was handed: subclasses (DTensor, fp8 wrappers) are not read, like in ``_tensors``."""
    return type(grad) not in (torch.Tensor, torch.nn.Parameter) or _finite(grad)


def _named_modules(model_chunks) -> list[tuple[str, torch.nn.Module]]:
    """Every module of the model chunks the optimizer was given (weak references), once each, named like their
    params."""
    chunks = [ref() for ref in model_chunks]
    named, seen = [], set()
    for c, chunk in enumerate(chunks):
        if chunk is None:  # the model was dropped: nothing to hook
            continue
        for name, module in chunk.named_modules():
            if id(module) not in seen:
                seen.add(id(module))
                prefix = "" if len(chunks) == 1 else str(c)
                named.append((".".join(part for part in (prefix, name) if part), module))
    return named


class _Call:
    """One call of a module: what its hooks share."""

    def __init__(self, name: str, module: torch.nn.Module, inputs_finite: bool):
        self.name, self.module, self.inputs_finite = name, module, inputs_finite
        self.aliases: set[int] = set()  # ids of the views handed to the module in place of its inputs
        self.returned: set[int] = set()  # those it returned as they were (an identity has no grad of its own)
        self.forward_finite = inputs_finite  # and its output, once it returned: only then can it be a
        #                                      backward source (a param's grad takes the input's NaN along)
        self.grad_out_bad = False  # a grad reaching one of its outputs was non-finite


class _Tracer:
    """Forward pre/post hooks on every module and tensor hooks on their values; finds the first source."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]]):
        self.modules = modules
        self.forward_source: Optional[ModuleSource] = None
        self.backward_source: Optional[ModuleSource] = None
        self.bad_grad_out: set[str] = set()  # modules some of whose output grads were non-finite
        self.bad_forward: set[str] = set()  # modules some of whose calls took or made a non-finite value
        self.handles: list = []
        self.stack: list[_Call] = []

    def install(self) -> None:
        for name, module in self.modules:
            self.handles.append(module.register_forward_pre_hook(partial(self._pre, name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(partial(self._post, name), with_kwargs=True))
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    self.handles.append(p.register_hook(partial(self._param_grad, name, module, pname)))

    def remove(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:  # module hooks and tensor hooks alike (a kept graph fires no stale ones)
            handle.remove()

    def _source(self, call: _Call, phase: str, what: str) -> ModuleSource:
        own_code = what in ("output", "grad of its input") and next(call.module.children(), None) is not None
        return ModuleSource(call.name, type(call.module).__name__, phase, what, own_code)

    # forward
    def _pre(self, name, module, args, kwargs):
        call = _Call(name, module, _all_finite((args, kwargs)))
        self.stack.append(call)
        if not torch.is_grad_enabled():
            return None
        memo: dict[int, torch.Tensor] = {}
        new_args, new_kwargs = self._alias(args, call, memo), self._alias(kwargs, call, memo)
        return (new_args, new_kwargs) if memo else None

    def _alias(self, value, call: _Call, memo: dict, depth: int = 0):
        """``value`` with each grad-requiring plain tensor replaced by a hooked view of itself (the same view
        for the same tensor, so a module's ``query is key`` checks still hold); containers rebuilt only
        where something inside them changed, and only plain tuples, lists and dicts."""
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor or not value.requires_grad or not value.is_floating_point():
                return value
            if id(value) not in memo:
                alias = value.view_as(value)
                memo[id(value)] = alias
                call.aliases.add(id(alias))
                self.handles.append(alias.register_hook(partial(self._input_grad, call, id(alias))))
            return memo[id(value)]
        if depth >= _MAX_DEPTH or type(value) not in (tuple, list, dict):
            return value
        if type(value) is dict:
            items = {k: self._alias(v, call, memo, depth + 1) for k, v in value.items()}
            return items if any(items[k] is not value[k] for k in value) else value
        items = [self._alias(v, call, memo, depth + 1) for v in value]
        return type(value)(items) if any(a is not b for a, b in zip(items, value)) else value

    def _post(self, name, module, args, kwargs, output):
        call = self._pop(module)
        if call is None:
            return None
        call.forward_finite = call.inputs_finite and _all_finite(output)
        if not call.forward_finite:
            self.bad_forward.add(name)
            if self.forward_source is None and call.inputs_finite:
                bad = [pname for pname, p in module.named_parameters(recurse=False) if not _finite(p.detach())]
                what = f"param '{bad[0]}'" if bad else "output"
                self.forward_source = self._source(call, "forward", what)
        for t in _tensors(output):
            if id(t) in call.aliases:
                call.returned.add(id(t))
            elif t.requires_grad:
                self.handles.append(t.register_hook(partial(self._output_grad, call)))
        return None

    def _pop(self, module) -> Optional[_Call]:
        # A submodule that raised (and whose caller caught it) never ran its post hook: skip its call.
        while self.stack:
            call = self.stack.pop()
            if call.module is module:
                return call
        return None

    # backward
    def _output_grad(self, call: _Call, grad: torch.Tensor) -> None:
        if not _grad_finite(grad):
            call.grad_out_bad = True
            self.bad_grad_out.add(call.name)

    def _input_grad(self, call: _Call, alias_id: int, grad: torch.Tensor) -> None:
        if self.backward_source is None and call.forward_finite and alias_id not in call.returned \
                and not call.grad_out_bad and not _grad_finite(grad):
            self.backward_source = self._source(call, "backward", "grad of its input")

    def _param_grad(self, name: str, module, pname: str, grad: torch.Tensor) -> None:
        if self.backward_source is None and name not in self.bad_grad_out | self.bad_forward \
                and not _grad_finite(grad):
            call = _Call(name, module, True)
            self.backward_source = self._source(call, "backward", f"grad of its param '{pname}'")


def trace_closure(model_chunks, closure: Optional[Callable]) -> Optional[ClosureTrace]:
    """Run ``closure`` (forward and backward) with grad enabled and hooks on every module of the model
    (``model_chunks``: weak references to its modules); return what they found (None when there is no closure).
    The hooks are removed even if it raises."""
    if closure is None:
        return None
    tracer = _Tracer(_named_modules(model_chunks))
    try:
        tracer.install()
        with torch.enable_grad():
            closure()
    finally:
        tracer.remove()
    # A forward source comes first: everything downstream of it, the backward too, is then non-finite.
    return ClosureTrace(tracer.forward_source or tracer.backward_source, len(tracer.modules))


# ---- the optimizer's side: which param and tensor, after which stage -------------------------------------
def _first_non_finite(domains, stage: str, *, grads_only: bool) -> Optional[NanOrigin]:
    for domain in domains:  # dense, then MoE expert params (graphstep/step/domains.py): each its own buffers
        origin = _first_in_domain(domain.buffers, domain.layout, domain.rank, stage, grads_only)
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
                    views.append(("main_param", buffers.read_part("main", place.buffer, r.shard_start, size)))
                for name in buffers.state:  # only the states its family keeps (graphstep/state/state_ranges.py)
                    if buffers.keeps_state(name, place.buffer, r.shard_start, size):
                        views.append((name, buffers.read_part(name, place.buffer, r.shard_start, size)))
        for tensor_name, view in views:
            if not _finite(view):
                return NanOrigin(stage, place.name, tensor_name)
    return None


def _with_source(origin: NanOrigin, trace: Optional[ClosureTrace]) -> NanOrigin:
    """The grads' origin, told where the model made it (when the closure ran under the hooks)."""
    if trace is None or trace.modules == 0:  # no closure, or no model left to hook
        return origin
    source = trace.source
    if source is None:
        return dataclasses.replace(origin, traced=True)
    return dataclasses.replace(origin, module=source.module, module_type=source.module_type, phase=source.phase,
                               source=source.describe(), traced=True)


def run_debug_step(domains, stages, device, tensors, trace: Optional[ClosureTrace] = None) -> StepReport:
    """The step's ``stages`` (the device stages, then the host ones: CPU offload's host update), one by one, over
    the sharding ``domains`` and the step's scalar ``tensors``; ``trace``: what ``trace_closure`` found while the
    closure ran, if one did."""
    origin = _first_non_finite(domains, "backward", grads_only=True)
    if origin is not None:
        origin = _with_source(origin, trace)
    stats = []
    for stage in stages:
        synchronize(device)
        start = time.perf_counter()
        stage.apply()
        synchronize(device)
        ms = (time.perf_counter() - start) * 1e3
        scalars = {name: float(getattr(tensors, name)) for name in SCALARS}
        stats.append(StageStats(stage.name, ms, scalars))
        if origin is None:
            origin = _first_non_finite(domains, stage.name, grads_only=False)
    source = None if trace is None else trace.source
    return StepReport(tuple(stats), origin, bool(tensors.update_successful), source)
