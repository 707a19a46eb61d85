"""The replay backend's recorded program: an op list over slots, and how it runs again.

Every tensor an op reads or produces is a *slot* of the environment of one replay:

* input slots 0..n-1: tensors that existed before the capture. The program holds them weakly
  (`_inputs.WeakInputs`); each replay first fetches them all, so a freed or replaced one is
  an error before any op runs, and they become the start of the environment in one list;
* placeholder slots n..: tensors recorded ops produced (temporaries, views, list outputs),
  recomputed at each replay and released after their last use.

Everything else in an op's arguments (Python scalars, dtypes, ProcessGroups, Generators) is
baked by reference.
"""
from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_leaves, tree_unflatten

from . import _c10d
from ._inputs import WeakInputs


@dataclass
class Instr:
    """One recorded op call.

    leaves/spec: the flattened (args, kwargs) with every non-tensor baked in and each tensor
    replaced by None; `subs` lists (leaf position, slot) for those tensors. `binds` lists
    (output leaf position, slot) for fresh outputs. `release` lists slots whose last use is this
    op (freed right after it). Positions are turned into index paths once (`Program._compile`)
    so replay does no pytree work.
    """

    func: Any
    spec: Any
    leaves: list
    subs: tuple
    binds: tuple
    works: tuple
    out_spec: Any = None
    release: tuple = ()
    # torch's fp32 matmul precision when the op was recorded: a step may set it around some matmuls
    # (Muon's Newton-Schulz runs "highest" inside a "medium" job); replay restores it per op, as the
    # kernels a CUDA graph captured keep the precision they were launched with.
    matmul_precision: str = "highest"
    # A custom op's body runs again at each replay (replay.py): with the grad mode it was recorded under,
    # since a torch.compile'd kernel inside is guarded on it. False for aten ops (below autograd).
    grad_enabled: bool = False
    # Filled by Program._compile: the call without pytree work at replay.
    baked: Optional[tuple] = None  # (args, kwargs) when no tensor is involved
    template: Optional[list] = None  # [args list, kwargs dict] with holes for tensors
    copies: tuple = ()  # paths of nested containers to copy before filling holes
    fills: tuple = ()  # (container path, ((key, slot), ...)) per container partly made of tensors
    wholes: tuple = ()  # (container path, slots, itemgetter) per list made of tensors only
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


def _refresh(captured: torch.Tensor, fresh: torch.Tensor) -> None:
    """Give the capture-time tensor the value this replay computed."""
    same_memory = (
        captured.data_ptr() == fresh.data_ptr()
        and captured.stride() == fresh.stride()
        and captured.shape == fresh.shape
    )
    if not same_memory:  # a view of static memory is already up to date
        captured.copy_(fresh)


class Program:
    """A recorded op list, the weak handles of its inputs, and how fn's outputs map onto slots.

    instrs:      the ops, in order (their slots are renumbered here: inputs first)
    inputs:      the pre-existing tensors, held weakly
    input_slots: the recording's slot of each input, in `inputs` order
    fresh:       slot -> tensor for every placeholder, as produced at recording (consumed here:
                 returned ones become outputs, ones still alive elsewhere are "escaped")
    """

    def __init__(self, instrs: list, inputs: WeakInputs, input_slots: list, fresh: dict, outputs: Any) -> None:
        self.instrs = instrs
        self.inputs = inputs
        fresh = self._renumber(input_slots, fresh)
        self.num_fresh = len(fresh)
        slot_of = {id(t): slot for slot, t in fresh.items()}
        # Outputs produced by recorded ops: refreshed by copy at every replay.
        self.out_binds = [
            (t, slot_of[id(t)]) for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and id(t) in slot_of
        ]
        self.escaped = self._find_escaped(fresh)
        self._plan_lifetimes()

    def _renumber(self, input_slots: list, fresh: dict) -> dict:
        """Inputs become slots 0..n-1 (so a replay's environment starts as the fetched input list)."""
        new = {slot: i for i, slot in enumerate(input_slots)}
        for slot in sorted(fresh):
            new[slot] = len(new)
        for ins in self.instrs:
            ins.subs = tuple((pos, new[slot]) for pos, slot in ins.subs)
            ins.binds = tuple((pos, new[slot]) for pos, slot in ins.binds)
        return {new[slot]: t for slot, t in fresh.items()}

    def _find_escaped(self, fresh: dict) -> list:
        """Temporaries still alive after fn returned without being returned by it.

        fn stored them somewhere (an attribute, a dict, a `.grad`). In a CUDA graph they
        are pool memory that each replay rewrites, so whoever holds them sees the latest
        step; we give them the same behaviour by copying into them at each replay, for
        as long as someone holds them (weak references). `capture.check` still reports
        them: it is rarely what the author meant.
        """
        returned = {id(t) for t, _ in self.out_binds}
        refs = [(weakref.ref(t), slot) for slot, t in fresh.items() if id(t) not in returned]
        fresh.clear()
        # No gc.collect() here (in a process that imported torch it costs more than a
        # recapture should): a temporary caught in a reference cycle counts as escaped
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
    def _compile(ins: Instr) -> None:
        """Turn leaf positions into index paths, so replay needs no pytree calls."""
        args, kwargs = tree_unflatten(ins.leaves, ins.spec)
        if not ins.subs:
            ins.baked = (args, kwargs)
        else:
            in_paths = _leaf_paths(ins.spec, len(ins.leaves))
            # Paths start with 0 (args) or 1 (kwargs): the root is [args, kwargs].
            holes = [(in_paths[pos], slot) for pos, slot in ins.subs]
            root = [list(args), dict(kwargs)]
            by_container: dict[tuple, list] = {}
            for path, slot in holes:
                by_container.setdefault(path[:-1], []).append((path[-1], slot))
            fills, wholes = [], []
            for path, fill in by_container.items():
                container = _at(root, path)
                if isinstance(container, (list, tuple)) and len(fill) > 1 \
                        and sorted(key for key, _ in fill) == list(range(len(container))):
                    # A list of tensors only (foreach arguments, often thousands long): built in one call.
                    slots = tuple(slot for _, slot in sorted(fill))
                    wholes.append((path, operator.itemgetter(*slots)))
                else:
                    fills.append((path, tuple(fill)))
            whole_paths = {path for path, _ in wholes}
            prefixes = {path[:i] for path, _ in fills for i in range(1, len(path) + 1)}
            prefixes |= {path[:i] for path in whole_paths for i in range(1, len(path))}
            ins.template = root
            ins.copies = tuple(sorted((p for p in prefixes if len(p) >= 2), key=len))
            ins.fills = tuple(fills)
            ins.wholes = tuple(wholes)
        if ins.binds or ins.works:
            n_out = ins.out_spec.num_leaves
            out_paths = _leaf_paths(ins.out_spec, n_out)
            ins.out_paths = tuple((out_paths[pos], slot) for pos, slot in ins.binds)
            ins.work_paths = tuple(out_paths[pos] for pos in ins.works)

    @staticmethod
    def _call_args(ins: Instr, env: list) -> tuple:
        if ins.baked is not None:
            return ins.baked
        args_t, kwargs_t = ins.template
        root = [list(args_t), dict(kwargs_t) if kwargs_t else kwargs_t]
        for path in ins.copies:  # nested lists holding tensors: fresh copies
            parent = _at(root, path[:-1])
            parent[path[-1]] = list(parent[path[-1]])
        for path, getter in ins.wholes:
            _at(root, path[:-1])[path[-1]] = list(getter(env))
        for path, fill in ins.fills:
            container = _at(root, path)
            for key, slot in fill:
                container[key] = env[slot]
        return root[0], root[1]

    def run(self) -> None:
        # Every input first: a freed or replaced one raises before any op has run.
        env: list[Any] = self.inputs.fetch()
        env += [None] * self.num_fresh
        # The recorded ops sit below autograd and autocast (their casts are already in
        # the list), but replay enters the dispatcher from the top: no_grad keeps
        # autograd from recording them or refusing in-place updates of leaf params, and
        # autocast is disabled so a caller's autocast region cannot recast them.
        caller_precision = precision = torch.get_float32_matmul_precision()
        try:
            with torch.no_grad(), torch._C._DisableAutocast():
                for ins in self.instrs:
                    if ins.matmul_precision != precision:
                        precision = ins.matmul_precision
                        torch.set_float32_matmul_precision(precision)
                    args, kwargs = self._call_args(ins, env)
                    if ins.grad_enabled:
                        with torch.enable_grad():
                            out = ins.func(*args, **kwargs)
                    else:
                        out = ins.func(*args, **kwargs)
                    for path, slot in ins.out_paths:
                        env[slot] = _at(out, path)
                    for path in ins.work_paths:
                        _c10d.wait(_at(out, path))
                    for slot in ins.release:
                        env[slot] = None
        finally:
            if precision != caller_precision:
                torch.set_float32_matmul_precision(caller_precision)
        with torch.no_grad():
            for captured, slot in self.out_binds:
                _refresh(captured, env[slot])
            for ref, slot in self.escaped:
                held = ref()
                if held is not None:
                    _refresh(held, env[slot])
