"""Collectives over torch.distributed for the step: explicit process groups, no global state; no-ops on one process.

The step calls torch's *functional* collectives (``torch.ops._c10d_functional``, the ``_out`` forms, in place on
the static buffers), not ``dist.reduce_scatter_tensor`` and friends: only they are clean dispatcher ops end to
end. The classic API's ``Work.wait()`` on gloo runs ops of its own on the caller's thread, which a dispatch-mode
recorder (the CPU replay backend) would bake into the graph as a copy from a dead temporary.

Failure: with gloo the step runs on graphstep's own copy of the data-parallel group, created with
``timeout=distributed_timeout_s``, so the timeout holds for every collective, eager or replayed; with NCCL on
the user's groups (``derive_group`` says why). A peer that dies or stops answering surfaces as
:class:`CollectiveError` naming the collective and the group; in a replayed capture ``Collectives.explain``
turns torch's RuntimeError into the same error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

_F = torch.ops._c10d_functional
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class CollectiveError(RuntimeError):
    """A collective of the optimizer step failed: a peer died, stopped answering, or the call was wrong."""

    def __init__(self, message: str, *, what: str, group: str):
        super().__init__(message)
        self.what = what
        self.group = group


def derive_group(group: dist.ProcessGroup, timeout_s: float) -> dist.ProcessGroup:
    """The group the step's collectives run on: for gloo, graphstep's own copy of ``group`` (same ranks)
    whose collectives time out after ``timeout_s``, so a dead or silent peer is a bounded
    ``CollectiveError``; for NCCL, ``group`` itself. A copy of an NCCL group is a second communicator per
    group (its buffers on every GPU, its set-up time at build) that buys nothing: torch's watchdog turns an
    eager NCCL timeout into a process abort, not an error, and replayed NCCL work has no watchdog at all
    (README, "Capture on GPUs"). Collective over ``group``'s members only; call it at build, on all of them."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return group
    return dist.new_group(dist.get_process_group_ranks(group), timeout=datetime.timedelta(seconds=timeout_s),
                          backend=backend, use_local_synchronization=True)


def host_group(ranks: list[int], timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over ``ranks``, for host-side exchanges (build-time objects, the ranks' recapture flags).
    On GPUs the step's groups are NCCL, whose object collectives stage through the *current* CUDA device: a
    job that never called ``torch.cuda.set_device`` would put every rank on GPU 0. gloo keeps them on the
    host. Collective over those ranks only."""
    return dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s),
                          use_local_synchronization=True)


def data_parallel_group(config, process_group) -> tuple[Optional[dist.ProcessGroup], int, int]:
    """(group, rank, size) the state is sharded over; size 1 without the distributed optimizer.

    With several ranks the group is graphstep's own copy of ``process_group`` (same ranks and backend)
    created with ``timeout=distributed_timeout_s``, so every collective of the step, eager or replayed,
    fails within that timeout when a peer dies or stops answering (see distributed.py). Creating it is
    collective over the group's members: all of them build the optimizer together.
    """
    if not config.use_distributed_optimizer:
        if process_group is not None and dist.get_world_size(process_group) > 1:
            raise ValueError("process_group has several ranks but use_distributed_optimizer=False: graphstep "
                             "reduces grads only with the distributed optimizer; set it True")
        return None, 0, 1
    if process_group is None:
        if not dist.is_initialized():
            return None, 0, 1
        process_group = dist.group.WORLD
    rank, size = dist.get_rank(process_group), dist.get_world_size(process_group)
    if rank < 0:
        raise ValueError("get_optimizer: this process is not a member of process_group; pass the "
                         "data-parallel group this rank belongs to")
    if size == 1:
        return None, 0, 1
    return derive_group(process_group, config.distributed_timeout_s), rank, size


def _describe(kind: str, group: dist.ProcessGroup, timeout_s: Optional[float]) -> str:
    ranks = dist.get_process_group_ranks(group)
    shown = ranks if len(ranks) <= 8 else ranks[:4] + ["..."] + ranks[-2:]
    timeout = "" if timeout_s is None else f", timeout {timeout_s:g} s"
    return f"the {kind} group (ranks {shown}, {dist.get_backend(group)}{timeout})"


def _peer_failure_hint(cause: BaseException, timeout_s: Optional[float]) -> str:
    text = str(cause)
    if "Timed out" in text or "timed out" in text or "timeout" in text:
        limit = "" if timeout_s is None else f" within distributed_timeout_s={timeout_s:g}"
        return f"a peer rank did not answer{limit} (it hangs, is slower, or took another code path)"
    if "Connection reset" in text or "Connection closed" in text or "closed by peer" in text or "pair" in text:
        return "a peer rank closed its connection (it crashed, was killed, or exited)"
    return "the collective raised"


class Collectives:
    """The step's collectives over a data-parallel group and an optional model-parallel group.

    Every method names what it runs (``what``), so a failure says which collective of which group broke.
    ``dp_group`` is the group the engine shards over (graphstep's own copy with the configured timeout,
    see ``derive_group``); ``mp_group`` is summed over as well for the grad statistics.

    Overlap state (driven by ``graphstep.hooks.grad_overlap``): ``overlap_enabled`` is the master switch; async
    collectives launched from hooks are kept in ``pending`` by key (``("reduce", bucket)`` or
    ``("gather", bucket)``) until the step (or a forward pre-hook) waits on them.
    """

    def __init__(self, dp_group: Optional[dist.ProcessGroup] = None, dp_size: int = 1,
                 mp_group: Optional[dist.ProcessGroup] = None, timeout_s: Optional[float] = None,
                 tp_group: Optional[dist.ProcessGroup] = None):
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.mp_group = mp_group
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        """The tensor-parallel group (Muon's split matrices: ``tp_all_gather``, ``tp_all_reduce_sum``), or None."""
        self.tp_size = 1 if self.tp_group is None else dist.get_world_size(self.tp_group)
        self.tp_rank = 0 if self.tp_group is None else dist.get_rank(self.tp_group)
        self.experts_split_elsewhere: frozenset[str] = frozenset()
        """The names of expert params that share this domain but are split over another TP group (they joined
        the dense layout): Muon refuses their split matrices rather than gather them over ``tp_group``."""
        self.timeout_s = timeout_s
        self.overlap_enabled = False
        self.defer_param_gather = False
        self.pending: dict[tuple, tuple[torch.Tensor, str]] = {}
        self.host_group: Optional[dist.ProcessGroup] = None  # gloo, over dp_group's ranks: built in setup()
        self.names: list[str] = []  # every collective the step runs, in order of first use
        self._mp_derived = False

    # ---- build time (object collectives allowed here, never in the step) ------------------------------
    def setup(self, layout, config, device) -> None:
        """Build-time checks over the data-parallel group; raises ValueError naming what differs.

        All ranks must plan the same layout (same params, shapes, groups, dtypes, buckets) and use the
        same config: otherwise the step's collectives would pair up buffers of different meaning (or
        hang). One ``all_gather_object`` here, over ``host_group`` (gloo, created here); the step itself
        never runs an object collective.

        Then every group the step uses runs one small all-reduce on ``device``: NCCL creates a
        communicator lazily, on a group's first collective, and that must not happen inside a CUDA
        graph capture, whatever ``capture_warmup_steps`` says.
        """
        if self.timeout_s is None:
            self.timeout_s = config.distributed_timeout_s
        if self.mp_group is not None and not self._mp_derived:
            self.mp_group = derive_group(self.mp_group, self.timeout_s)
            self._mp_derived = True
        if self.dp_size > 1:
            if self.host_group is None:
                self.host_group = host_group(dist.get_process_group_ranks(self.dp_group), self.timeout_s)
            self._check_same_layout(layout, config)
        self._warm_up(device)

    def _check_same_layout(self, layout, config) -> None:
        mine = (layout.fingerprint(), _config_items(config))
        everyone: list = [None] * self.dp_size
        self._guard("layout check all_gather_object", self.host_group,
                    lambda: dist.all_gather_object(everyone, mine, group=self.host_group))
        rank = dist.get_rank(self.dp_group)
        for other, theirs in enumerate(everyone):
            if theirs != mine:
                raise ValueError(f"graphstep: data-parallel rank {rank} and rank {other} "
                                 f"{_difference(mine, theirs, rank, other)}; every data-parallel rank must "
                                 "build the optimizer over the same model and OptimizerConfig")

    def _warm_up(self, device) -> None:
        probe = torch.zeros(1, device=device)
        groups = ((self.dp_group if self.dp_size > 1 else None, "data-parallel"), (self.mp_group, "model-parallel"),
                  (self.tp_group, "tensor-parallel"))
        for group, kind in groups:
            if group is not None:
                self._guard("communicator warm-up all_reduce", group,
                            lambda: _F.wait_tensor(_F.all_reduce_(probe, "sum", group.group_name)), kind=kind)

    # ---- the step's collectives ------------------------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor, what: str) -> None:
        """Sum ``tensor`` in place over the data-parallel, then the model-parallel group."""
        if self.dp_size > 1:
            self._named(what)
            self._guard(what, self.dp_group,
                        lambda: _F.wait_tensor(_F.all_reduce_(tensor, "sum", self.dp_group.group_name)))
        if self.mp_group is not None:
            self._named(what + " (model-parallel)")
            self._guard(what, self.mp_group,
                        lambda: _F.wait_tensor(_F.all_reduce_(tensor, "sum", self.mp_group.group_name)),
                        kind="model-parallel")

    def all_reduce_max(self, tensor: torch.Tensor, what: str) -> None:
        """Elementwise MAX of ``tensor`` in place over the data-parallel group only (QK-clip's per-head max
        logits, fp8 amaxes: replicated across data-parallel ranks, split, not replicated, across model-parallel
        ones)."""
        if self.dp_size > 1:
            self._named(what)
            self._guard(what, self.dp_group,
                        lambda: _F.wait_tensor(_F.all_reduce_(tensor, "max", self.dp_group.group_name)))

    def tp_all_gather(self, whole: torch.Tensor, mine: torch.Tensor, what: str) -> None:
        """``whole`` ← every tensor-parallel rank's ``mine``, in rank order (flat tensors)."""
        self._named(what)
        self._guard(what, self.tp_group, lambda: _F.wait_tensor(
            _F.all_gather_into_tensor_out(mine, self.tp_size, self.tp_group.group_name, out=whole)),
                    kind="tensor-parallel")

    def tp_all_reduce_sum(self, tensor: torch.Tensor, what: str) -> None:
        """Sum ``tensor`` in place over the tensor-parallel group."""
        self._named(what)
        self._guard(what, self.tp_group,
                    lambda: _F.wait_tensor(_F.all_reduce_(tensor, "sum", self.tp_group.group_name)),
                    kind="tensor-parallel")

    def reduce_scatter(self, shard: torch.Tensor, whole: torch.Tensor, what: str, *, op: str = "sum",
                       key: Optional[tuple] = None) -> None:
        """``shard`` ← this rank's piece of ``whole`` reduced (``op``: "avg" or "sum") over the dp group.

        With ``key`` the collective is launched asynchronously and kept in ``pending`` until ``wait(key)``.
        """
        self._named(what)
        launch = lambda: _F.reduce_scatter_tensor_out(whole, op, self.dp_size, self.dp_group.group_name,
                                                      out=shard)
        self._start(shard, what, launch, key)

    def all_gather(self, whole: torch.Tensor, mine: torch.Tensor, what: str, *, key: Optional[tuple] = None) -> None:
        """``whole`` ← every rank's ``mine``, in rank order; in place when ``mine`` is this rank's slice.

        fp8 tensors (graphstep.fp8 weights) travel as their bytes: gloo has no fp8 type, and a byte copy is
        exact for any dtype. 1 byte per element either way."""
        self._named(what)
        if whole.dtype in _FP8_DTYPES:
            whole, mine = whole.view(torch.uint8), mine.view(torch.uint8)
        launch = lambda: _F.all_gather_into_tensor_out(mine, self.dp_size, self.dp_group.group_name, out=whole)
        self._start(whole, what, launch, key)

    def wait(self, key: tuple) -> bool:
        """Finish the pending collective ``key``; False when none was pending."""
        entry = self.pending.pop(key, None)
        if entry is None:
            return False
        out, what = entry
        self._guard(what, self.dp_group, lambda: _F.wait_tensor(out))
        return True

    def wait_all(self, kind: Optional[str] = None) -> None:
        """Finish every pending collective (of ``kind``: "reduce" or "gather"), in launch order."""
        for key in [k for k in self.pending if kind is None or k[0] == kind]:
            self.wait(key)

    # ---- errors ----------------------------------------------------------------------------------------
    def explain(self, exc: BaseException, where: str = "the captured step") -> CollectiveError:
        """A CollectiveError for a RuntimeError raised where Python did not name the collective (a replay)."""
        names = ", ".join(self.names) if self.names else "none recorded"
        group = self.dp_group if self.dp_group is not None else self.mp_group
        return self._error(f"one of the collectives of {where} ({names})", group, None, exc)

    def _start(self, out: torch.Tensor, what: str, launch, key: Optional[tuple]) -> None:
        if key is None:
            self._guard(what, self.dp_group, lambda: _F.wait_tensor(launch()))
            return
        if key in self.pending:
            self.wait(key)
        self._guard(what, self.dp_group, launch)
        self.pending[key] = (out, what)

    def _named(self, what: str) -> None:
        if what not in self.names:
            self.names.append(what)

    def _guard(self, what: str, group, fn, kind: str = "data-parallel"):
        start = time.monotonic()
        try:
            return fn()
        except CollectiveError:
            raise
        except RuntimeError as exc:
            raise self._error(what, group, time.monotonic() - start, exc, kind) from exc

    def _error(self, what: str, group, elapsed: Optional[float], cause: BaseException,
               kind: str = "data-parallel") -> CollectiveError:
        where = _describe(kind, group, self.timeout_s) if group is not None else f"the {kind} group"
        after = "" if elapsed is None else f" after {elapsed:.1f} s"
        first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        message = (f"graphstep: collective '{what}' on {where} failed{after}: "
                   f"{_peer_failure_hint(cause, self.timeout_s)}. Look for the first error in the other "
                   f"ranks' logs. Cause: {first_line}")
        return CollectiveError(message, what=what, group=where)

    @contextlib.contextmanager
    def named_errors(self, where: str = "the captured step") -> Iterator[None]:
        """Turn a collective's RuntimeError inside the block (a replayed capture, where graphstep's Python
        does not run) into a CollectiveError listing the step's collectives. Other errors pass through."""
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as exc:
            if (self.dp_size > 1 or self.mp_group is not None) and is_collective_failure(exc):
                raise self.explain(exc, where) from exc
            raise


def is_collective_failure(exc: BaseException) -> bool:
    """Whether a RuntimeError came from a collective's backend (gloo, NCCL) rather than from the math."""
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc)
    return any(marker in text for marker in ("gloo", "Gloo", "NCCL", "nccl", "c10d", "Connection reset",
                                              "Connection closed", "Timed out", "timed out"))


# ---- layout/config comparison (build time) -----------------------------------------------------------
def _config_items(config) -> tuple:
    return tuple((f.name, repr(getattr(config, f.name))) for f in dataclasses.fields(config))


def _difference(mine: tuple, theirs: tuple, rank: int, other: int) -> str:
    """What differs between two ranks' (layout fingerprint, config items), in words."""
    (layout_a, config_a), (layout_b, config_b) = mine, theirs
    for (name, a), (_, b) in zip(config_a, config_b):
        if a != b:
            return f"differ in OptimizerConfig.{name}: rank {rank} has {a}, rank {other} has {b}"
    labels = ("data-parallel size", "number of param groups")
    for label, a, b in zip(labels, layout_a[:2], layout_b[:2]):
        if a != b:
            return f"differ in the {label}: rank {rank} has {a}, rank {other} has {b}"
    params_a, params_b = layout_a[2], layout_b[2]
    for i, (a, b) in enumerate(zip(params_a, params_b)):
        if a != b:
            return (f"lay out param {i} differently: rank {rank} has {_param_words(a)}, "
                    f"rank {other} has {_param_words(b)}")
    if len(params_a) != len(params_b):
        extra = params_a[len(params_b)] if len(params_a) > len(params_b) else params_b[len(params_a)]
        return (f"have different numbers of trainable params: rank {rank} has {len(params_a)}, rank {other} "
                f"has {len(params_b)} (first unmatched: {_param_words(extra)})")
    return f"plan different buffers: rank {rank} has {layout_a[3]}, rank {other} has {layout_b[3]}"


def _param_words(entry: tuple) -> str:
    name, shape, group, buffer, start = entry
    return f"'{name}' shape {tuple(shape)} in group {group}, buffer {buffer} at {start}"
