"""The update as ``torch.compile``d elementwise loops over the views: 28 bytes per param, every value live.

Why a third implementation: torch's fused kernels write the divided grads back whenever they are given a
grad scale (4 more bytes per param on every clipped or loss-scaled step), and take betas, eps and weight
decay only as Python floats, which a capture bakes in. Here the per-step scalars (bias corrections, step
size, decay factor, the grad scale, the skip flag) are computed from device tensors into one small
coefficient tensor, and the compiled loop reads them from it: it reads param, grad and state once and
writes param and state once (28 B for Adam over fp32), never the grads, and no hyperparameter is baked
into anything. A skipped step selects the old values with ``torch.where`` inside the same loop, so skips
are bitwise. Grads are left as they were (not divided by the grad scale), unlike the fused and reference
kernels. One compile serves views of every length (``_ROW``), and each call is one operator to the
dispatcher (``_adam_op``, ``_sgd_op``).
On the CPU, Adam over fp32 views runs the same loop in graphstep's native library (``native_adam_covers``):
bitwise the same, without a process's seconds of starting dynamo and inductor, even with their cache warm.
"""

from __future__ import annotations

import functools
import time
import types
import weakref
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..native import update_loops
from .adam_coefficients import (BC2_SQRT, BETA1, BETA2, DECAY, EPS, KEEP, ONE_MINUS_BETA1, ONE_MINUS_BETA2, SCALE,
                                STEP_SIZE, WD, adam_coefficients)

# The inductor options every compiled update is compiled with (re-exported: the engine, scalar graphs and the
# GPU check's preflight read them from here).
from .inductor_options import (COMPILE_OPTIONS, compile_options, cpu_vector_isa,  # noqa: F401
                               missing_compile_options, vector_width_option)

LIVE_FIELDS = frozenset({"lr", "weight_decay", "beta1", "beta2", "eps", "momentum"})

# Positions in the SGD coefficient tensor.
_SGD_LR, _SGD_WD, _SGD_MOMENTUM, _SGD_SCALE, _SGD_KEEP = range(5)


def adam_values(param, grad, exp_avg, exp_avg_sq, c) -> tuple:
    """One Adam step's new (param, exp_avg, exp_avg_sq) from their values and a coefficient row ``c``, the skip
    selected: the arithmetic of every compiled Adam loop (this module's, and compiled_stored.py's over decoded
    values; graphstep/native/adam_element.h repeats it op for op)."""
    # torch.optim's operation order (Adam: grad + wd * param; AdamW: param * (1 - lr * wd) first).
    g = grad.to(param.dtype) / c[SCALE] + param * c[WD]
    new_exp_avg = exp_avg * c[BETA1] + g * c[ONE_MINUS_BETA1]
    new_exp_avg_sq = exp_avg_sq * c[BETA2] + g * g * c[ONE_MINUS_BETA2]
    denom = new_exp_avg_sq.sqrt() / c[BC2_SQRT] + c[EPS]
    new_param = param * c[DECAY] - c[STEP_SIZE] * new_exp_avg / denom
    keep = c[KEEP] > 0
    return (torch.where(keep, new_param, param), torch.where(keep, new_exp_avg, exp_avg),
            torch.where(keep, new_exp_avg_sq, exp_avg_sq))


def _adam_loop(param, grad, exp_avg, exp_avg_sq, c):
    for tensor, value in zip((param, exp_avg, exp_avg_sq), adam_values(param, grad, exp_avg, exp_avg_sq, c)):
        tensor.copy_(value)


def _sgd_loop(param, grad, c):
    g = grad.to(param.dtype) / c[_SGD_SCALE] + param * c[_SGD_WD]
    param.copy_(torch.where(c[_SGD_KEEP] > 0, param - c[_SGD_LR] * g, param))


def _sgd_momentum_loop(param, grad, momentum_buffer, c):
    g = grad.to(param.dtype) / c[_SGD_SCALE] + param * c[_SGD_WD]
    keep = c[_SGD_KEEP] > 0
    new_buffer = momentum_buffer * c[_SGD_MOMENTUM] + g
    # Momentum 0 (a schedule's) leaves the buffer as it is, as torch's SGD does: the step is plain SGD.
    momentum_buffer.copy_(torch.where(keep & (c[_SGD_MOMENTUM] != 0), new_buffer, momentum_buffer))
    param.copy_(torch.where(keep, param - c[_SGD_LR] * new_buffer, param))


def _sgd_nesterov_loop(param, grad, momentum_buffer, c):
    g = grad.to(param.dtype) / c[_SGD_SCALE] + param * c[_SGD_WD]
    keep = c[_SGD_KEEP] > 0
    new_buffer = momentum_buffer * c[_SGD_MOMENTUM] + g
    momentum_buffer.copy_(torch.where(keep & (c[_SGD_MOMENTUM] != 0), new_buffer, momentum_buffer))
    param.copy_(torch.where(keep, param - c[_SGD_LR] * (g + c[_SGD_MOMENTUM] * new_buffer), param))


def _adam_views(params, grads, exp_avgs, exp_avg_sqs, hypers, step, grad_scale, found_inf, decoupled, part_groups):
    # The coefficients are computed in the compiled graph itself (no separate small ops before the loop);
    # each part reads its group's row of them: several groups in one call.
    coefficients = adam_coefficients(hypers, step, grad_scale, found_inf, decoupled).to(params[0].dtype)
    for param, grad, exp_avg, exp_avg_sq, group in zip(params, grads, exp_avgs, exp_avg_sqs, part_groups):
        _adam_loop(param, grad, exp_avg, exp_avg_sq, coefficients[group])


def _sgd_views(params, grads, c):
    for param, grad in zip(params, grads):
        _sgd_loop(param, grad, c)


def _sgd_momentum_views(params, grads, momentum_buffers, c):
    for param, grad, buffer in zip(params, grads, momentum_buffers):
        _sgd_momentum_loop(param, grad, buffer, c)


def _sgd_nesterov_views(params, grads, momentum_buffers, c):
    for param, grad, buffer in zip(params, grads, momentum_buffers):
        _sgd_nesterov_loop(param, grad, buffer, c)


# One compiled call covers all of a param group's views, and for Adam all of its groups' (``adam_groups``):
# each call pays dynamo's and AOT's bookkeeping whatever its size, so fewer calls are faster
# (docs/perf-notes.md, "The update kernels"). Views run as (rows, _ROW) matrices with the row count dynamic
# and the row length static: one compile serves views of every length, and the inner loop stays a
# fixed-length vector loop (faster than fully dynamic 1-D shapes); the < _ROW leftover elements of a view
# run as (n, 1). Separate functions per variant (SGD with and without momentum, nesterov) keep their
# compiles apart.
_ROW = 64
_RECOMPILE_LIMIT = 32


@functools.cache
def _compiled(views_fn, count: int, flags: tuple = (), device_type: str = "cpu"):
    """``views_fn`` compiled for lists of ``count`` views on ``device_type`` (and Adam's ``flags``: decoupled,
    grad scale given). Inductor compiles it on its first call (C++/OpenMP on the CPU, Triton on a GPU), then
    it is cached for the process.

    Dynamo keeps its compiled variants, and its recompile limit, per code object: one code object per
    view count and flags keeps optimizers of different layouts and configs in one process (a sweep, a
    test suite) from crowding one another out of a shared limit.
    """
    suffix = "".join(f"_{int(flag)}" for flag in flags)
    code = views_fn.__code__.replace(co_name=f"{views_fn.__name__}_{count}{suffix}")
    # No size asserts in the generated code: dynamo's guards have checked every view's shape and strides
    # before the call, and the asserts (several per view) cost time every call. Dynamic threads: with Adam's
    # coefficient math in the same C++ kernel as its loops, inductor emitted no parallel region at all (one
    # core did the work); with the thread count left to OpenMP at run time the loops run in a parallel
    # region again, the scalar math before it.
    return torch.compile(types.FunctionType(code, views_fn.__globals__), fullgraph=True, dynamic=False,
                         options=compile_options(device_type))


def _cuts(n: int) -> list[tuple[int, int, int]]:
    """A 1-D view of ``n`` elements as its (rows, _ROW) body and (leftover, 1) tail: (start, end, row width)
    of each, empty parts dropped."""
    body = n - n % _ROW
    return [(lo, hi, width) for lo, hi, width in ((0, body, _ROW), (body, n, 1)) if hi > lo]


def _as_rows(views: list) -> list:
    """Each 1-D view cut into its ``_cuts`` parts, as matrices."""
    parts = []
    for view in views:
        for lo, hi, width in _cuts(view.numel()):
            part = view.detach()[lo:hi].view(-1, width)
            if part.shape[0] > 1:  # a single row stays static (dynamo specializes sizes 0 and 1)
                torch._dynamo.mark_dynamic(part, 0)
            parts.append(part)
    return parts


class _Rows:
    """A call site's views cut by ``_as_rows``, kept for its next calls once it has passed the same views
    twice: an engine passes the same views every step, and cutting them again (slices, reshapes,
    ``mark_dynamic``) costs more than the compiled call's own dispatch (docs/perf-notes.md). A caller
    passing fresh tensors every call (grads a ``zero_grad`` reallocated) is only remembered by weak
    references, so no memory of it outlives its call. The cut is valid while every
    view is the same live tensor object, in the same lists, at the same address, shape and strides: a
    freed view, whose id a new tensor may take, is a miss, never a stale hit."""

    def __init__(self, lists: tuple):
        tensors = [view for views in lists for view in views]
        self._refs = tuple(weakref.ref(view) for view in tensors)
        self._fingerprint = _fingerprint(lists)
        self.parts = None  # the cut, once the same views came a second time
        self.cuts_per_view = [len(_cuts(view.numel())) for view in lists[0]]
        self._variants = {}

    def variant(self, views_fn, parts, rest) -> tuple:
        """``_variant`` of a call over these parts, computed once per function and other arguments."""
        key = (views_fn, _static_arguments(rest))
        if key not in self._variants:
            self._variants[key] = _variant(views_fn, parts, rest)
        return self._variants[key]

    def hold(self, lists: tuple) -> bool:
        """Whether these are the views this entry was made of, still where they were."""
        tensors = [view for views in lists for view in views]
        return (len(tensors) == len(self._refs) and all(ref() is view for ref, view in zip(self._refs, tensors))
                and _fingerprint(lists) == self._fingerprint)


def _fingerprint(lists: tuple) -> tuple:
    return tuple(tuple((view.data_ptr(), view.shape, view.stride()) for view in views) for views in lists)


# Keyed by a call's first view, weakly: an entry goes with the views it cut (an engine's, when it is freed).
_rows_by_first_view = WeakIdKeyDictionary()


def _rows(lists: tuple) -> tuple[_Rows, list]:
    """The call's entry and its views cut (kept in the entry from the second call over the same views)."""
    first = lists[0][0]
    rows = _rows_by_first_view.get(first)
    if rows is None or not rows.hold(lists):
        _rows_by_first_view[first] = _Rows(lists)
        return _rows_by_first_view[first], [_as_rows(views) for views in lists]
    if rows.parts is None:
        rows.parts = [_as_rows(views) for views in lists]
    return rows, rows.parts


def _part_groups(rows: _Rows, view_groups: list[int]) -> list[int]:
    """Per part of ``rows``, the group of the view it was cut from."""
    return [group for group, cuts in zip(view_groups, rows.cuts_per_view) for _ in range(cuts)]


# Variants already run in this process, and the seconds their first calls took (compile included).
_seen_variants: set = set()
_first_call_seconds = [0.0]


def compile_seconds() -> float:
    """Seconds this process spent in the first call of each compiled variant (its compile, then one run),
    the update's and the scalar graphs' (graphstep/step/compiled_scalar_math.py): what ``kernel="compiled"`` (or "auto"
    choosing it) costs up front."""
    return _first_call_seconds[0]


def _variant(views_fn, parts, rest) -> tuple:
    # What dynamo specializes on: the function, the view count, per part its dtype, device, row width and
    # whether its row count is a static 1 (see _as_rows), and the other arguments (``_static_arguments``).
    return (views_fn, len(parts[0]), tuple((p.dtype, p.device, p.shape[1], p.shape[0] == 1)
                                           for views in parts for p in views), _static_arguments(rest))


def _static_arguments(rest) -> tuple:
    # Of the arguments after the views, what dynamo guards on: a tensor's dtype, device and shape (the small
    # scalar inputs: SGD's coefficients; Adam's hyperparameter table, step, grad scale and skip flag, all
    # compiled static), and the value of the rest (Adam's part groups, a list of ints; ``decoupled``;
    # whether a grad scale is given at all).
    return tuple((r.dtype, r.device, tuple(r.shape)) if isinstance(r, torch.Tensor) else
                 tuple(r) if isinstance(r, list) else r for r in rest)


def _run(views_fn, lists: tuple, *rest, view_groups=None, flags: tuple = ()) -> None:
    # Plain (detached) views on every call: dynamo guards on them.
    rows, parts = _rows(lists)
    if view_groups is not None:  # Adam: each part reads its group's row of the coefficients
        rest = rest + (_part_groups(rows, view_groups),)
    device_type = parts[0][0].device.type
    call_compiled(_compiled(views_fn, len(parts[0]), flags, device_type), *parts, *rest,
                  variant=rows.variant(views_fn, parts, rest))


def call_compiled(fn, *args, variant) -> None:
    """Call ``fn``, a ``torch.compile``d function, the way every compiled call of graphstep's runs: in no-grad
    mode every time (dynamo guards on the grad mode) and with dynamo's recompile limit raised for this call
    only (each compiled function has a few legitimate variants: single rows, tails, views with and
    without autograd's view tracking, a device's dtypes; with fullgraph=True going past the limit is an
    error, not a slower fallback). The first call of each ``variant`` (a hashable naming what dynamo
    specializes on) is timed into ``compile_seconds()``; a dynamo or inductor error in it is raised as one
    line that says what to build with instead (the original chained)."""
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
        start = time.perf_counter() if variant not in _seen_variants else None
        try:
            fn(*args)
        except Exception as error:
            if start is None or not type(error).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise
            # Its first call compiles it: inductor's own error is pages of generated C++ or Triton.
            first_line = (str(error).strip().splitlines() or [""])[0][:200]
            raise RuntimeError(f"graphstep: kernel='compiled': torch.compile could not compile the step's kernel "
                               f"({type(error).__name__}: {first_line}); build with kernel='fused', or "
                               f"kernel='auto', which checks torch.compile at build and falls back to "
                               f"'fused' by itself") from error
        if start is not None:
            _seen_variants.add(variant)
            _first_call_seconds[0] += time.perf_counter() - start


# Each compiled call is wrapped in a ``torch.library`` custom op, so that it is one operator to the dispatcher:
# capture's replay backend records and replays it like any aten op, and ``capture.check`` sees what it reads
# and writes. One call per step covers all of Adam's param groups (``adam_groups``); SGD runs one per group.
@torch.library.custom_op("graphstep::compiled_adam_", mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def _adam_op(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
             exp_avg_sqs: list[torch.Tensor], hypers: torch.Tensor, step: torch.Tensor,
             grad_scale: Optional[torch.Tensor], found_inf: torch.Tensor, decoupled: bool,
             view_groups: list[int]) -> None:
    if native_adam_covers(params, grads, exp_avgs, exp_avg_sqs):
        _native_adam(params, grads, exp_avgs, exp_avg_sqs, hypers, step, grad_scale, found_inf, decoupled,
                     view_groups)
        return
    _run(_adam_views, (params, grads, exp_avgs, exp_avg_sqs), hypers, step, grad_scale, found_inf, decoupled,
         view_groups=view_groups, flags=(decoupled, grad_scale is not None))


def native_adam_covers(*views: list) -> bool:
    """Whether an Adam call over these lists of views (params, grads, exp_avgs, exp_avg_sqs) runs the native
    loop (graphstep/native/update_loops.py: fp32 views on the CPU, where the library builds) instead of
    ``torch.compile``: the same update, bitwise, without dynamo's and inductor's start in the process."""
    return update_loops.covers(*views) and update_loops.library() is not None


def _native_adam(params, grads, exp_avgs, exp_avg_sqs, hypers, step, grad_scale, found_inf, decoupled, view_groups):
    # The coefficients as eager ops: the same ops the compiled graph computes them with, so the same bits.
    coefficients = adam_coefficients(hypers, step, grad_scale, found_inf, decoupled).to(torch.float32)
    for param, grad, exp_avg, exp_avg_sq, group in zip(params, grads, exp_avgs, exp_avg_sqs, view_groups):
        update_loops.adam(param, grad, exp_avg, exp_avg_sq, coefficients[group])


@_adam_op.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, hypers, step, grad_scale, found_inf, decoupled, view_groups) -> None:
    return None


@torch.library.custom_op("graphstep::compiled_sgd_", mutates_args=("params", "momentum_buffers"))
def _sgd_op(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
            coefficients: torch.Tensor, nesterov: bool) -> None:
    if not momentum_buffers:
        _run(_sgd_views, (params, grads), coefficients)
    else:
        views_fn = _sgd_nesterov_views if nesterov else _sgd_momentum_views
        _run(views_fn, (params, grads, momentum_buffers), coefficients)


@_sgd_op.register_fake
def _(params, grads, momentum_buffers, coefficients, nesterov) -> None:
    return None


def _scalars(*values, like: torch.Tensor) -> list[torch.Tensor]:
    """Hyperparameters as 0-d tensors in ``like``'s dtype and device. A float (only when the kernel is
    called directly: the engine passes every hyperparameter as a device tensor) becomes a ``full`` fill,
    a constant the device writes, not a tensor copied in from host memory, which a capture refuses."""
    return [(v if v.dtype == like.dtype else v.to(like.dtype)) if isinstance(v, torch.Tensor)
            else torch.full((), float(v), dtype=like.dtype, device=like.device) for v in values]


def _pack(values, dtype) -> torch.Tensor:
    """0-d scalars as one small tensor in the params' dtype (what the loop reads): stacked in their own
    precision (a bool flag promotes to 0 or 1), then cast once; the same values as casting each, in two
    device ops instead of one per scalar."""
    return torch.stack(values).to(dtype)


def _precision(lr, device) -> torch.Tensor:
    # The scalar math runs in the hyperparameters' precision (fp64 on the CPU, like torch.optim's).
    return lr if isinstance(lr, torch.Tensor) else torch.zeros((), dtype=torch.float64, device=device)


def adam(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, weight_decay, eps, decoupled,
         grad_scale, found_inf):
    adam_groups([(params, grads, exp_avgs, exp_avg_sqs, dict(lr=lr, beta1=beta1, beta2=beta2,
                                                              weight_decay=weight_decay, eps=eps))],
                step=step, decoupled=decoupled, grad_scale=grad_scale, found_inf=found_inf)


def adam_groups(groups, *, step, decoupled, grad_scale, found_inf):
    """Several param groups' Adam in one compiled call: every view reads its group's row of the (groups, 11)
    coefficients, which the compiled graph computes first from the groups' hyperparameters
    (``adam_coefficients``)."""
    groups = [g for g in groups if g[0]]
    if not groups:
        return
    device = groups[0][0][0].device
    views, view_groups = ([], [], [], []), []
    for index, (params, grads, exp_avgs, exp_avg_sqs, _) in enumerate(groups):
        for into, tensors in zip(views, (params, grads, exp_avgs, exp_avg_sqs)):
            into.extend(tensors)
        view_groups += [index] * len(params)
    _adam_op(*views, _hyper_table([g[4] for g in groups], device), step, grad_scale, found_inf, decoupled,
             view_groups)


_ADAM_FIELDS = ("lr", "beta1", "beta2", "weight_decay", "eps")


def _hyper_table(hypers: list[dict], device) -> torch.Tensor:
    """The groups' hyperparameters as one (groups, 5) tensor (columns ``_ADAM_FIELDS``) in group 0's
    hyperparameter precision (the engine's are all one dtype): one ``stack``. A table, not 0-d tensors,
    goes into the compiled graph: dynamo reads a 0-d fp64 CPU tensor argument as a Python float behind a
    guard (an ``.item()`` per call), where a table is an ordinary tensor input, read live."""
    like = _precision(hypers[0]["lr"], device)
    table = torch.stack(_scalars(*(hyper[name] for hyper in hypers for name in _ADAM_FIELDS), like=like))
    return table.view(len(hypers), len(_ADAM_FIELDS))


def sgd(params, grads, momentum_buffers, *, lr, weight_decay, momentum, nesterov, grad_scale, found_inf):
    """One param group's SGD in one compiled call; its few coefficients are packed by two device ops before it
    (``_pack``)."""
    if not params:
        return
    lr, weight_decay, momentum = _scalars(lr, weight_decay, momentum, like=_precision(lr, params[0].device))
    scale = torch.ones_like(lr) if grad_scale is None else grad_scale.to(lr.dtype)
    coefficients = _pack((lr, weight_decay, momentum, scale, found_inf == 0), params[0].dtype)
    _sgd_op(list(params), list(grads), list(momentum_buffers), coefficients, nesterov)


# What this implementation offers the families (graphstep/kernels/__init__.py): entry point -> function.
ENTRY_POINTS = dict(adam=adam, adam_groups=adam_groups, sgd=sgd)
