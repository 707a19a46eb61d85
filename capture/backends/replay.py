"""The CPU replay backend: CUDA-graph semantics without a GPU, so CI tests capture.

Recording: one call of fn runs under a TorchDispatchMode that appends every aten op
(below autograd, after Python decompositions) to a program. Replay: that op list runs
again on the same storages, and Python is not re-run. This reproduces what a CUDA
graph would do to a step:

* Python scalars in op arguments are baked in. `p.add_(g, alpha=-lr)` with a Python
  float lr keeps the capture-time lr forever; a 0-d tensor lr filled in place between
  replays is read live. Same for `torch.tensor(...)` made inside the step: it becomes a
  constant (it arrives through `aten.lift_fresh` as a tensor no recorded op produced).
* Tensors that existed before the capture (closed-over params, buffers, constants) are
  referenced by the program; tensors produced by recorded ops (temporaries, views,
  slices, list outputs of foreach ops) are placeholders, recomputed at each replay.
  In-place and out= ops return their input, so they map to that same tensor.
* Host syncs (`.item()`, `if t:`, `.tolist()`, nonzero, boolean masks, ...) raise
  CaptureError while recording, naming the op and the user's file:line. The list of
  unsafe ops is `capture.unsafe`, shared with `capture.check`.
* c10d collectives (`c10d.allreduce_`, `c10d._reduce_scatter_base_`, ...) are replayed;
  the ProcessGroup and ReduceOp objects are baked by reference, and every Work an op
  returns is waited on at once, at recording and at replay (a stronger sync than an
  async caller's, always safe). See `_c10d.py` for why ops inside Work.wait() are not
  recorded. Functional collectives (`_c10d_functional.all_reduce` + `wait_tensor`)
  are ordinary ops returning fresh tensors and replay like any other.
* A tensor that aliases a temporary without any aten op (`torch.from_dlpack(tmp)`) is
  recorded as an `as_strided` view of the placeholder, so it follows each replay.
* fn's return value at capture is graph-owned: each replay copies its fresh tensors'
  new values into those same objects. Outputs are graph-owned: clone what you keep.

What differs from a CUDA graph:
* Recording executes the ops, so the capture call is a real step (the CUDA backend
  replays right after capturing so that both count the capture call as one step).
* Temporaries are allocated anew at each replay (no private memory pool). A tensor
  made inside the step and stored somewhere (an escaping tensor, see capture.check)
  is copied into at each replay, which is what a CUDA graph's pool reuse amounts to;
  unlike in a CUDA graph, no other tensor can come to share its memory.
* Ops run one by one through the dispatcher: it saves Python, not kernel launches.
* Effects Python performs without an aten op (assigning `.data` or `.grad`, setting
  attributes, printing) happen at capture only. Storage objects passed to ops
  (`set_(storage)`) are baked by reference like constants.
* RNG ops draw from the global generator at each replay, so a replayed run draws the
  same numbers as the eager run would; a CUDA graph advances Philox offsets instead.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from .. import _location
from ..errors import DEVICE_TO_HOST, HOST_SYNC, CaptureError, Finding
from ..unsafe import HostReadMode, classify, op_name
from . import _c10d

# Kinds the recorder refuses: a replay would reuse the value the host read at capture.
_REFUSED = (HOST_SYNC, DEVICE_TO_HOST)


@dataclass
class _Instr:
    """One recorded op call.

    leaves/spec: the flattened (args, kwargs) with tensors that existed before capture
    and every non-tensor baked in; `subs` lists (leaf position, slot) for tensors that
    recorded ops produce. `binds` lists (output leaf position, slot) for fresh outputs.
    `release` lists slots whose last use is this op (freed right after it). Positions
    are turned into index paths once (`_Program._compile`) so replay does no pytree work.
    """

    func: Any
    spec: Any
    leaves: list
    subs: tuple
    binds: tuple
    works: tuple
    out_spec: Any = None
    release: tuple = ()
    # Filled by _Program._compile: the call without pytree work at replay.
    baked: Optional[tuple] = None  # (args, kwargs) when no placeholder is involved
    template: Optional[list] = None  # [args list, kwargs dict] with holes for placeholders
    copies: tuple = ()  # paths of nested containers to copy before filling holes
    holes: tuple = ()  # (path, slot)
    out_paths: tuple = ()  # (path into the op's result, slot)
    work_paths: tuple = ()  # paths of Work objects in the op's result


def _leaf_paths(spec: Any, n: int) -> list:
    """Index path of each pytree leaf: unflatten the leaf numbers, then walk.

    Every int in the unflattened structure is a leaf number (pytree containers are
    lists, tuples, dicts and None here, and none of them is an int).
    """
    paths: list = [None] * n

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, int):
            paths[node] = path
        elif isinstance(node, (list, tuple)):
            for i, child in enumerate(node):
                walk(child, path + (i,))
        elif isinstance(node, dict):
            for k, child in node.items():
                walk(child, path + (k,))

    walk(tree_unflatten(list(range(n)), spec), ())
    return paths


def _at(root: Any, path: tuple) -> Any:
    for key in path:
        root = root[key]
    return root


class _Recorder(TorchDispatchMode):
    """Runs each op and appends it to the program; refuses host syncs."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label
        self.instrs: list[_Instr] = []
        self.slot_of: dict[int, int] = {}
        # Every tensor a recorded op produced stays alive until recording ends, so an
        # id() can never be reused by another tensor and confuse slot_of.
        self.keepalive: list[torch.Tensor] = []
        # Storage of each allocation a recorded op made -> slot of its first tensor.
        self.storage_slot: dict[int, int] = {}
        self.refusal: Optional[CaptureError] = None

    def _new_slot(self, t: torch.Tensor) -> int:
        slot = len(self.keepalive)
        self.keepalive.append(t)
        self.slot_of[id(t)] = slot
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
            return None  # memory from before the capture: a constant by reference
        base = self.keepalive[base_slot]
        if base.dtype != x.dtype:
            raise CaptureError(
                f"cannot capture {self.label!r}: a tensor reinterprets a temporary's memory as "
                f"{x.dtype} (was {base.dtype}) without an aten op; use Tensor.view(dtype)"
            )
        leaves, spec = tree_flatten(((base, tuple(x.size()), tuple(x.stride()), x.storage_offset()), {}))
        leaves[0] = None
        slot = self._new_slot(x)
        self.instrs.append(
            _Instr(
                torch.ops.aten.as_strided.default, spec, leaves, ((0, base_slot),), ((0, slot),), (),
                tree_flatten(x)[1],
            )
        )
        return slot

    def refuse(self, kind: str, func: Any) -> CaptureError:
        filename, lineno, line = _location.user_location()
        finding = Finding(kind, op_name(func), filename, lineno, line)
        err = CaptureError(
            f"cannot capture {self.label!r}: it reads device data on the host, so a replay "
            "would reuse the value read at capture. Compute the decision on device "
            "(torch.where, masks, found_inf tensors) instead",
            [finding],
        )
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
        if kind in _REFUSED:
            raise self.refuse(kind, func)

        leaves, spec = tree_flatten((args, kwargs))
        subs = []
        input_ids, input_storages = set(), set()
        for pos, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                input_ids.add(id(x))
                input_storages.add(_storage_key(x))
                slot = self.slot_of.get(id(x))
                if slot is None:
                    slot = self._alias_of_fresh(x)
                if slot is not None:
                    subs.append((pos, slot))
                    leaves[pos] = None  # filled from the environment at replay
        out = func(*args, **kwargs)

        binds, works = [], []
        for pos, y in enumerate(tree_flatten(out)[0]):
            if isinstance(y, torch.Tensor):
                if id(y) not in input_ids:  # in-place / out= results are their input
                    slot = self._new_slot(y)
                    binds.append((pos, slot))
                    key = _storage_key(y)
                    if key and key not in input_storages:  # a new allocation, not a view
                        self.storage_slot.setdefault(key, slot)
            elif _c10d.is_work(y):
                works.append(pos)
                _c10d.wait(y)
        out_spec = tree_flatten(out)[1] if (binds or works) else None
        self.instrs.append(_Instr(func, spec, leaves, tuple(subs), tuple(binds), tuple(works), out_spec))
        return out


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage
        return 0


def _refresh(captured: torch.Tensor, fresh: torch.Tensor) -> None:
    """Give the capture-time tensor the value this replay computed."""
    same_memory = (
        captured.data_ptr() == fresh.data_ptr()
        and captured.stride() == fresh.stride()
        and captured.shape == fresh.shape
    )
    if not same_memory:  # a view of static memory is already up to date
        captured.copy_(fresh)


class _Program:
    """A recorded op list plus how fn's outputs map onto its placeholders."""

    def __init__(self, rec: _Recorder, outputs: Any) -> None:
        self.instrs = rec.instrs
        self.num_slots = len(rec.keepalive)
        # Outputs produced by recorded ops: refreshed by copy at every replay.
        self.out_binds = [
            (t, rec.slot_of[id(t)])
            for t in tree_leaves(outputs)
            if isinstance(t, torch.Tensor) and id(t) in rec.slot_of
        ]
        self.escaped = self._find_escaped(rec)
        self._plan_lifetimes()

    def _find_escaped(self, rec: _Recorder) -> list:
        """Temporaries still alive after fn returned without being returned by it.

        fn stored them somewhere (an attribute, a dict, a `.grad`). In a CUDA graph they
        are pool memory that each replay rewrites, so whoever holds them sees the latest
        step; we give them the same behaviour by copying into them at each replay, for
        as long as someone holds them (weak references). `capture.check` still reports
        them: it is rarely what the author meant.
        """
        returned = {id(t) for t, _ in self.out_binds}
        refs = [(weakref.ref(t), slot) for slot, t in enumerate(rec.keepalive) if id(t) not in returned]
        rec.keepalive.clear()
        # No gc.collect() here (it costs ~0.1-0.3 s in a process that imported torch, at
        # every recapture): a temporary caught in a reference cycle counts as escaped
        # until the collector frees it, which only costs a copy per replay meanwhile.
        return [(ref, slot) for ref, slot in refs if ref() is not None]

    def _plan_lifetimes(self) -> None:
        keep = {slot for _, slot in self.out_binds} | {slot for _, slot in self.escaped}
        last_use: dict[int, int] = {}
        for i, ins in enumerate(self.instrs):
            for _, slot in ins.binds:
                last_use[slot] = i  # a never-read output dies right after its op
            for _, slot in ins.subs:
                last_use[slot] = i
            self._compile(ins)
        release: dict[int, list[int]] = {}
        for slot, i in last_use.items():
            if slot not in keep:
                release.setdefault(i, []).append(slot)
        for i, slots in release.items():
            self.instrs[i].release = tuple(slots)

    @staticmethod
    def _compile(ins: _Instr) -> None:
        """Turn leaf positions into index paths, so replay needs no pytree calls."""
        args, kwargs = tree_unflatten(ins.leaves, ins.spec)
        if not ins.subs:
            ins.baked = (args, kwargs)
        else:
            in_paths = _leaf_paths(ins.spec, len(ins.leaves))
            # Paths start with 0 (args) or 1 (kwargs): the root is [args, kwargs].
            holes = tuple((in_paths[pos], slot) for pos, slot in ins.subs)
            prefixes = {path[:i] for path, _ in holes for i in range(2, len(path))}
            ins.template = [list(args), dict(kwargs)]
            ins.copies = tuple(sorted(prefixes, key=len))
            ins.holes = holes
        if ins.binds or ins.works:
            n_out = ins.out_spec.num_leaves
            out_paths = _leaf_paths(ins.out_spec, n_out)
            ins.out_paths = tuple((out_paths[pos], slot) for pos, slot in ins.binds)
            ins.work_paths = tuple(out_paths[pos] for pos in ins.works)

    @staticmethod
    def _call_args(ins: _Instr, env: list) -> tuple:
        if ins.baked is not None:
            return ins.baked
        args_t, kwargs_t = ins.template
        root = [list(args_t), dict(kwargs_t) if kwargs_t else kwargs_t]
        for path in ins.copies:  # nested lists holding placeholders: fresh copies
            parent = _at(root, path[:-1])
            parent[path[-1]] = list(parent[path[-1]])
        for path, slot in ins.holes:
            _at(root, path[:-1])[path[-1]] = env[slot]
        return root[0], root[1]

    def run(self) -> None:
        env: list[Any] = [None] * self.num_slots
        # The recorded ops sit below autograd and autocast (their casts are already in
        # the list), but replay enters the dispatcher from the top: no_grad keeps
        # autograd from recording them or refusing in-place updates of leaf params, and
        # autocast is disabled so a caller's autocast region cannot recast them.
        with torch.no_grad(), torch._C._DisableAutocast():
            for ins in self.instrs:
                args, kwargs = self._call_args(ins, env)
                out = ins.func(*args, **kwargs)
                for path, slot in ins.out_paths:
                    env[slot] = _at(out, path)
                for path in ins.work_paths:
                    _c10d.wait(_at(out, path))
                for slot in ins.release:
                    env[slot] = None
            for captured, slot in self.out_binds:
                _refresh(captured, env[slot])
            for ref, slot in self.escaped:
                held = ref()
                if held is not None:
                    _refresh(held, env[slot])


class ReplayBackend:
    """Record once, replay the aten op list. See the module docstring."""

    name: ClassVar[str] = "replay"

    def __init__(self, *, pool: Any = None, label: str = "step") -> None:
        # `pool` is accepted for interface parity; the replay backend has no pool.
        self._label = label
        self._program: Optional[_Program] = None
        self._outputs: Any = None

    @staticmethod
    def usable(tensors) -> bool:
        return True

    def warmup(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def capture(self, fn: Callable[[], Any]) -> Any:
        rec = _Recorder(self._label)

        def refuse_host_read(func: Any) -> None:
            raise rec.refuse(HOST_SYNC, func)

        host_reads = HostReadMode(refuse_host_read)
        with _c10d.hide_ops_inside_wait(), host_reads, rec:
            outputs = fn()
        if rec.refusal is not None:
            raise rec.refusal
        self._program = _Program(rec, outputs)
        self._outputs = outputs
        return outputs

    def replay(self) -> Any:
        assert self._program is not None, "replay() before capture()"
        self._program.run()
        return self._outputs

    def reset(self) -> None:
        self._program = None
        self._outputs = None

    def close(self) -> None:
        self.reset()
