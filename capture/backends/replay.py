"""The CPU replay backend: CUDA-graph semantics without a GPU, so CI tests capture.

Recording runs fn once under a TorchDispatchMode that appends every aten op to a program; a replay runs that op
list again on the same storages, and Python is not re-run. So, as in a CUDA graph: Python scalars in op
arguments are baked in, while a 0-d tensor filled in place is read live; tensors from before the capture are
held weakly (``_inputs.py``); tensors the recorded ops produce are recomputed at each replay; host syncs,
tensors made from Python data, unsafe copies, undeclared RNG and what ``_strict.py`` checks raise
``CaptureError`` with the op and the user's file:line while recording (``capture.unsafe``). Recording runs the
ops, so a refused capture call has already applied the ops before the refused one: fix the step rather than
retrying it. Custom ops are recorded as one op and called again; c10d collectives are replayed with every Work
waited on at once (``_c10d.py``); storage resizes (FSDP2's) are replayed too (``_storage.py``). fn's return
value is graph-owned: clone what you keep. What differs from a CUDA graph (no private pool, Python-only effects
at capture only, RNG drawn anew): docs/capture.md.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import _location
from .._custom_ops import called_by_the_user, caller_dispatch_state, is_custom
from ..errors import (DEVICE_TO_HOST, HOST_SYNC, HOST_TENSOR, HOST_TO_DEVICE, HOST_WORK, LAZY_INIT,
                      NOT_CAPTURABLE, RNG, TEMPORARY_RESIZE, CaptureError, Finding)
from ..unsafe import HostReadMode, classify, op_name
from . import _c10d, _storage, _strict
from ._inputs import WeakInputs, describe_first_use
from ._program import Instr, Program
from .base import CaptureOptions

# Kinds the recorder always refuses, and what to do instead.
_ADVICE = {
    HOST_SYNC: "it reads device data on the host, so a replay would reuse the value read at capture. Compute "
               "the decision on device (torch.where, masks, found_inf tensors) instead",
    DEVICE_TO_HOST: "it copies device data to the host, so a replay would reuse the value read at capture. Keep "
                    "the value on device and read it outside the step",
    HOST_TO_DEVICE: "it copies host memory to the device inside the step; a CUDA capture refuses that copy (a "
                    "sync from pageable memory). Keep the tensor on the device and refresh it in place before "
                    "the step, or copy non_blocking from pinned memory",
    HOST_TENSOR: "it makes a tensor from Python data inside the step (torch.tensor / as_tensor); on a GPU that "
                 "is a host-to-device copy a CUDA capture refuses, and its value would be frozen at capture. "
                 "Make the tensor once outside the step and fill_() it before each step, or pass a Python "
                 "scalar if the value is a constant",
    RNG: "it draws random numbers, which a CUDA graph replays only from generators registered with it. If "
         "that is intended, capture with allow_rng=True",
    HOST_WORK: "it runs host (CPU) ops inside a step on a device: a CUDA graph records device work only, so "
               "they would run at capture and never again (and a CPU scalar read by a device op is frozen). "
               "Keep the step's tensors on its device",
    LAZY_INIT: "first-time setup ran during the capture, which a CUDA capture cannot contain; run the step "
               "eagerly before capturing (warmup >= 1) so that it happens in warm-up",
    _strict.STREAM_ORDER: "it breaks the order a CUDA capture needs between streams: a forked side stream must "
                          "be joined back (capturing_stream.wait_stream(side)) before the capture ends, events "
                          "waited on inside it must be recorded inside it, and a tensor another stream writes "
                          "(FSDP2's reduce-scatter) must be waited for (its event) before the step starts",
    NOT_CAPTURABLE: "torch.optim's step raises under a CUDA capture when a param group has capturable=False "
                    "(fused=True included); build the optimizer with capturable=True (graphstep.wrap sets it "
                    "on fused Adam/AdamW groups, where it changes nothing in the math)",
    TEMPORARY_RESIZE: "it resizes the storage of a tensor the step itself made: the replay backend replays storage "
                      "resizes of tensors made before the capture (FSDP2's unsharded params), not of a temporary, "
                      "which each replay allocates anew. Make the tensor before capturing, or use Tensor.resize_",
}


class _Recorder(TorchDispatchMode):
    """Runs each op and appends it to the program; refuses what a CUDA capture would."""

    def __init__(self, label: str, options: CaptureOptions) -> None:
        super().__init__()
        self.label = label
        self.refused = {HOST_SYNC, DEVICE_TO_HOST, HOST_TO_DEVICE, HOST_TENSOR} | (
            set() if options.allow_rng else {RNG})
        self.instrs: list[Instr] = []
        self.num_slots = 0
        self.slot_of: dict[int, int] = {}
        # Every tensor seen while recording stays alive until recording ends, so an id()
        # can never be reused by another tensor and confuse slot_of. `fresh`: produced by
        # recorded ops (slot -> tensor); `inputs`: existed before (weak handles after).
        self.fresh: dict[int, torch.Tensor] = {}
        self.inputs = WeakInputs()
        self.input_slots: list[int] = []  # slot of each input, in WeakInputs order
        self.input_keepalive: list[torch.Tensor] = []
        # Storage of each allocation a recorded op made -> slot of its first tensor.
        self.storage_slot: dict[int, int] = {}
        self.device_rule = _strict.DeviceStepRule()
        self.stream_rules = _strict.StreamRules()
        # The dispatch-key state of the code that starts the recording (capture/_custom_ops.py).
        self.dispatch_tls = caller_dispatch_state()
        self.refusal: Optional[CaptureError] = None
        self.resized: set[int] = set()  # storages the step resized (``_storage.py``)
        self._in_op = 0  # inside an op's own body, whose effects the op's replay repeats

    def on_resize(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """A storage resize the step's own code is about to make: replayed as it happens, on the same storage."""
        if self._in_op or _c10d.inside_wait():
            return
        if storage.data_ptr() in self.storage_slot:
            raise self.refuse(TEMPORARY_RESIZE, None, "UntypedStorage.resize_")
        leaves, spec = tree_flatten(((storage, nbytes), {}))
        self.instrs.append(Instr(_storage.resize_storage, spec, leaves, (), (), ()))
        self.resized.add(_storage.storage_id(storage))

    def _new_slot(self, t: torch.Tensor) -> int:
        slot = self.num_slots
        self.num_slots += 1
        self.slot_of[id(t)] = slot
        return slot

    def _fresh_slot(self, t: torch.Tensor) -> int:
        slot = self._new_slot(t)
        self.fresh[slot] = t
        return slot

    def _input_slot(self, t: torch.Tensor, func: Any) -> int:
        slot = self._new_slot(t)
        self.input_keepalive.append(t)
        self.inputs.add(t, describe_first_use(t, op_name(func), _location.user_location()))
        self.input_slots.append(slot)
        return slot

    def _alias_of_fresh(self, x: torch.Tensor) -> Optional[int]:
        """Slot for an unknown tensor that aliases a temporary, else None.

        `tmp.data`, `tmp.detach()` under some paths, and tensors rebuilt from a storage
        make new Tensor objects without dispatching anything. If one views memory that
        a recorded op allocated, baking it would point replays at the capture-time
        buffer; instead we record an as_strided view of the placeholder, which is what
        the alias is.
        """
        base_slot = self.storage_slot.get(_storage_key(x))
        if base_slot is None:
            return None  # memory from before the capture: an input
        base = self.fresh[base_slot]
        if base.dtype != x.dtype:
            raise CaptureError(
                f"cannot capture {self.label!r}: a tensor reinterprets a temporary's memory as "
                f"{x.dtype} (was {base.dtype}) without an aten op; use Tensor.view(dtype)"
            )
        leaves, spec = tree_flatten(((base, tuple(x.size()), tuple(x.stride()), x.storage_offset()), {}))
        leaves[0] = None
        slot = self._fresh_slot(x)
        self.instrs.append(
            Instr(
                torch.ops.aten.as_strided.default, spec, leaves, ((0, base_slot),), ((0, slot),), (),
                tree_flatten(x)[1],
            )
        )
        return slot

    def refuse(self, kind: str, func: Any, op: Optional[str] = None) -> CaptureError:
        filename, lineno, line = _location.user_location()
        return self.refuse_findings(kind, [Finding(kind, op or op_name(func), filename, lineno, line)])

    def refuse_findings(self, kind: str, findings: list) -> CaptureError:
        err = CaptureError(f"cannot capture {self.label!r}: {_ADVICE[kind]}", findings)
        # Kept even if fn swallows the exception: the capture must still fail.
        self.refusal = self.refusal or err
        return err

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _c10d.inside_wait():
            # gloo completing a collective inside Work.wait(): part of the c10d op we
            # already recorded (and waited on); replaying it would copy stale buffers.
            return func(*args, **kwargs)
        kind = classify(func, args, kwargs)
        if kind in self.refused:
            raise self.refuse(kind, func)
        unused_groups = _strict.first_use_groups(func, args, kwargs)
        if unused_groups:
            raise self.refuse(LAZY_INIT, func, f"{op_name(func)} is the first collective on process group "
                                               f"{', '.join(unused_groups)}")

        leaves, spec = tree_flatten((args, kwargs))
        subs, tensors = [], []
        input_ids, input_storages = set(), set()
        for pos, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                tensors.append(x)
                input_ids.add(id(x))
                input_storages.add(_storage_key(x))
                slot = self.slot_of.get(id(x))
                if slot is None:
                    slot = self._alias_of_fresh(x)
                if slot is None:
                    slot = self._input_slot(x, func)
                subs.append((pos, slot))
                leaves[pos] = None  # filled from the environment at replay
        self._in_op += 1
        try:
            if is_custom(func):  # one op to the recorder; its body runs as the step's code would run it
                with called_by_the_user(self.dispatch_tls):
                    out = func(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
        finally:
            self._in_op -= 1

        binds, works = [], []
        for pos, y in enumerate(tree_flatten(out)[0]):
            if isinstance(y, torch.Tensor):
                tensors.append(y)
                if id(y) not in input_ids:  # in-place / out= results are their input
                    slot = self._fresh_slot(y)
                    binds.append((pos, slot))
                    key = _storage_key(y)
                    if key and key not in input_storages:  # a new allocation, not a view
                        self.storage_slot.setdefault(key, slot)
            elif _c10d.is_work(y):
                works.append(pos)
                _c10d.wait(y)
        self.device_rule.observe(func, tensors)
        self.stream_rules.on_op(func, args, kwargs, out)
        out_spec = tree_flatten(out)[1] if (binds or works) else None
        self.instrs.append(Instr(func, spec, leaves, tuple(subs), tuple(binds), tuple(works), out_spec,
                                 matmul_precision=torch.get_float32_matmul_precision(),
                                 grad_enabled=is_custom(func) and torch.is_grad_enabled()))
        return out


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage
        return 0


class ReplayBackend:
    """Record once, replay the aten op list. See the module docstring."""

    name: ClassVar[str] = "replay"
    capture_runs_ops: ClassVar[bool] = True  # recording runs each op

    def __init__(self, *, pool: Any = None, label: str = "step", options: Optional[CaptureOptions] = None) -> None:
        # `pool` is accepted for interface parity; the replay backend has no pool.
        self._label = label
        self._options = options or CaptureOptions()
        self._program: Optional[Program] = None
        self._outputs: Any = None
        self._custom_ops = False  # whether the program calls custom ops (whose bodies run at each replay)

    @staticmethod
    def usable(tensors) -> bool:
        return True

    def warmup(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def capture(self, fn: Callable[[], Any]) -> Any:
        rec = _Recorder(self._label, self._options)

        def refuse_host_read(func: Any) -> None:
            raise rec.refuse(HOST_SYNC, func)

        host_reads = HostReadMode(refuse_host_read)
        optimizer_check = _strict.OptimizerCaptureCheck(lambda found: rec.refuse_findings(NOT_CAPTURABLE, found))
        with _strict.LazyInitWatch() as lazy, optimizer_check, _c10d.hide_ops_inside_wait(), rec.stream_rules, \
                _storage.record_resizes(rec.on_resize), host_reads, rec:
            outputs = fn()
        if rec.refusal is not None:
            raise rec.refusal
        stream_order = rec.stream_rules.findings()
        if stream_order:
            raise rec.refuse_findings(_strict.STREAM_ORDER, stream_order)
        if lazy.findings:
            raise rec.refuse_findings(LAZY_INIT, lazy.findings)
        host_work = rec.device_rule.findings()
        if host_work:
            raise rec.refuse_findings(HOST_WORK, host_work)
        rec.inputs.follow_storages(rec.resized)
        self._program = Program(rec.instrs, rec.inputs, rec.input_slots, rec.fresh, outputs)
        self._custom_ops = any(is_custom(instr.func) for instr in rec.instrs)
        rec.input_keepalive.clear()  # from here on the inputs are held weakly only
        self._outputs = outputs
        return outputs

    def replay(self) -> Any:
        assert self._program is not None, "replay() before capture()"
        if not self._custom_ops:
            self._program.run()
            return self._outputs
        # A custom op's body runs again at each replay. A compile starting there means the guards of a
        # torch.compile'd kernel inside it failed: a CUDA graph would replay the kernel it captured, with
        # what that kernel baked in, so the twin refuses rather than quietly running the new one.
        with _strict.LazyInitWatch() as compiles:
            self._program.run()
        if compiles.findings:
            raise CaptureError(f"cannot replay {self._label!r}: a torch.compile'd kernel inside a custom op "
                               "compiled again during the replay (its guards failed: a Python value it reads "
                               "changed), which a CUDA graph would not see: it replays the kernel it captured. "
                               "Invalidate the graph (recapture) when such a value changes", compiles.findings)
        return self._outputs

    def reset(self) -> None:
        self._program = None
        self._outputs = None

    def close(self) -> None:
        self.reset()

    def pool_bytes(self) -> Optional[int]:
        return None  # a replayed op list reuses the live tensors; it keeps no memory pool
