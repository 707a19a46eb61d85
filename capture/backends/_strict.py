"""The replay backend's rules for what a CUDA capture would refuse that a plain op recorder would not.

docs/design.md §9: the CPU replay backend is the strict twin of a CUDA graph. Per-op rules live in
``capture.unsafe``; this module holds the rules that need more context than one op: host (CPU) work inside a
step that runs on a device (run once at capture, never replayed, so refused); lazy initialisation during the
recording (``LazyInitWatch``: a torch.compile compiling, a process group's first collective, which NCCL sets up
uncapturably); stream and event order (``StreamRules`` over ``StandInStream`` / ``StandInEvent``, since on the
CPU every ``torch.Stream`` is one stream and ``torch.Event`` cannot be made); and torch.optim's capture health
check (``OptimizerCaptureCheck``), which a CPU build skips. Not detected (docs/capture.md): cuBLAS/cuDNN setup,
allocator growth, and a torch.compile'd function called directly in the step (dynamo does not run under a
TorchDispatchMode): wrap compiled kernels in a ``torch.library`` custom op, as graphstep does.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import _location
from ..errors import HOST_WORK, LAZY_INIT, NOT_CAPTURABLE, Finding

__all__ = ["LazyInitWatch", "OptimizerCaptureCheck", "first_use_groups", "DeviceStepRule", "StandInStream",
           "StandInEvent", "StreamRules", "current_stream", "STREAM_ORDER"]

_PG_TYPE = "__torch__.torch.classes.c10d.ProcessGroup"


def _finding(kind: str, op: str) -> Finding:
    filename, lineno, line = _location.user_location()
    return Finding(kind, op, filename, lineno, line)


class LazyInitWatch:
    """While active, notes every dynamo compilation that starts (findings: `lazy_init`)."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self._handler = _dynamo_callbacks()

    def _on_compile_start(self, args: Any) -> None:
        compile_id = getattr(args, "compile_id", "?")
        self.findings.append(_finding(LAZY_INIT, f"torch.compile (dynamo compile {compile_id})"))

    def __enter__(self) -> "LazyInitWatch":
        if self._handler is not None:
            self._handler.register_start_callback(self._on_compile_start)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._handler is not None:
            self._handler.remove_start_callback(self._on_compile_start)


class OptimizerCaptureCheck:
    """While active, torch.optim's capture health check behaves as under a CUDA capture on every device:
    a step over a param group with ``capturable=False`` is refused (``refuse(findings)`` builds the error)."""

    def __init__(self, refuse) -> None:
        self._refuse = refuse
        self._saved = None

    def _check(self, optimizer: torch.optim.Optimizer) -> None:
        if torch.compiler.is_compiling():  # torch skips the check while tracing, and so does a capture
            return
        groups = [g for g, group in enumerate(optimizer.param_groups) if not group.get("capturable", False)]
        if groups:
            op = f"{type(optimizer).__name__}.step with capturable=False in param group(s) {groups}"
            raise self._refuse([_finding(NOT_CAPTURABLE, op)])

    def __enter__(self) -> "OptimizerCaptureCheck":
        check = self._check
        self._saved = torch.optim.Optimizer.__dict__.get("_accelerator_graph_capture_health_check")
        if self._saved is not None:
            torch.optim.Optimizer._accelerator_graph_capture_health_check = lambda optimizer: check(optimizer)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved is not None:
            torch.optim.Optimizer._accelerator_graph_capture_health_check = self._saved


def _dynamo_callbacks() -> Optional[Any]:
    """dynamo's global compile-callback registry, or None where this torch has none."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # pragma: no cover - older or stripped torch builds
        return None
    return callback_handler


_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "c10d_functional")


def _groups_in(func: Any, args: tuple, kwargs: dict) -> list:
    """The process groups a collective op names: ProcessGroup script objects for c10d ops, group names
    (strings) for functional collectives (``_c10d_functional.all_reduce_(t, "sum", group_name)``)."""
    namespace = getattr(func, "namespace", None)
    groups = []
    for x in tree_leaves((args, kwargs)):
        try:
            if namespace == "c10d" and isinstance(x, torch.ScriptObject) and x._type().qualified_name() == _PG_TYPE:
                groups.append(torch._C._distributed_c10d.ProcessGroup.unbox(x))
            elif namespace in _FUNCTIONAL_NAMESPACES and isinstance(x, str):
                groups.append(torch.distributed.distributed_c10d._resolve_process_group(x))
        except (RuntimeError, ValueError, KeyError, AttributeError):  # a reduce op's name, not a group
            continue
    return groups


def first_use_groups(func: Any, args: tuple, kwargs: dict) -> list[str]:
    """Names of the process groups a collective op (c10d or functional) runs on that have never run one."""
    if getattr(func, "namespace", None) not in ("c10d", *_FUNCTIONAL_NAMESPACES) \
            or not torch.distributed.is_available():
        return []
    unused = []
    for group in _groups_in(func, args, kwargs):
        try:
            seq = group._get_sequence_number_for_group()
        except (RuntimeError, AttributeError):  # a backend without sequence numbers: cannot tell
            continue
        if seq == 0:
            unused.append(f"{group.group_name!r} ({group.name()}, size {group.size()})")
    return unused


class DeviceStepRule:
    """Collects host (CPU) work seen while recording; `findings()` reports it if the step ran on a device."""

    def __init__(self) -> None:
        self.step_device: Optional[torch.device] = None
        self._host: list[Finding] = []
        self._seen: set = set()

    def observe(self, func: Any, tensors: list) -> None:
        """Note the devices of one recorded op's tensors (inputs and outputs)."""
        host = False
        for t in tensors:
            if t.device.type == "cpu":
                host = True
            elif self.step_device is None:
                self.step_device = t.device
        if not host:
            return
        if self.step_device is None and self._host:
            return  # maybe a CPU-only step (then all of this is fine): one located op is enough for now
        finding = _finding(HOST_WORK, str(func))
        key = (finding.op, finding.filename, finding.lineno)
        if key not in self._seen:  # one finding per op and line, not per call
            self._seen.add(key)
            self._host.append(finding)

    def findings(self) -> list[Finding]:
        return list(self._host) if self.step_device is not None else []


# ---- streams and events: the ordering rules of a CUDA capture, on stand-ins the CPU can run --------------------
STREAM_ORDER = "stream_order"  # a stream or event rule of CUDA capture broken (finding kind)


class StandInStream:
    """A device stream as the capture rules see it. ``ops``: how many ops ran on it; ``seen[s]``: how many
    of stream ``s``'s ops this stream is ordered after (by waits, transitively)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops = 0
        self.seen: "weakref.WeakKeyDictionary[StandInStream, int]" = weakref.WeakKeyDictionary()
        self.written: dict[int, int] = {}  # storage -> this stream's op count when it last wrote it
        self._log: Optional[_StreamWrites] = None

    def __repr__(self) -> str:
        return f"StandInStream({self.name!r})"

    def __enter__(self) -> "StandInStream":
        _CURRENT.append(self)
        if not _ACTIVE:  # outside a recording, note what this stream writes (a recording notes it itself)
            self._log = _StreamWrites(self)
            self._log.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._log is not None:
            self._log.__exit__(*exc)
            self._log = None
        _CURRENT.pop()

    def record_event(self, event: Optional["StandInEvent"] = None) -> "StandInEvent":
        event = event or StandInEvent()
        event.record(self)
        return event

    def wait_event(self, event: "StandInEvent") -> None:
        if event.stream is None:
            return  # never recorded: a wait on it is a no-op, as on CUDA
        if _ACTIVE:
            _ACTIVE[-1].on_wait(self, event)
        for stream, ops in event.seen.items():
            self.seen[stream] = max(self.seen.get(stream, 0), ops)

    def wait_stream(self, other: "StandInStream") -> None:
        self.wait_event(other.record_event())


class StandInEvent:
    """A device event as the capture rules see it: recorded on a stream, waited on by others."""

    def __init__(self) -> None:
        self.stream: Optional[StandInStream] = None
        self.seen: dict = {}
        self.capture: Optional[StreamRules] = None  # the capture it was recorded inside, if any

    def record(self, stream: Optional[StandInStream] = None) -> None:
        self.stream = stream or current_stream()
        self.seen = {**dict(self.stream.seen.items()), self.stream: self.stream.ops}
        self.capture = _ACTIVE[-1] if _ACTIVE and self.stream in _ACTIVE[-1].streams else None

    def wait(self, stream: Optional[StandInStream] = None) -> None:
        (stream or current_stream()).wait_event(self)

    def synchronize(self) -> None:
        if _ACTIVE:
            _ACTIVE[-1].add(f"event.synchronize() on {self.stream!r} inside the capture: a host sync")

    def query(self) -> bool:
        if _ACTIVE:
            _ACTIVE[-1].add(f"event.query() on {self.stream!r} inside the capture: a host sync")
        return True


DEFAULT_STREAM = StandInStream("default")
_CURRENT: list[StandInStream] = [DEFAULT_STREAM]
_ACTIVE: list["StreamRules"] = []
_WRITERS: "weakref.WeakSet[StandInStream]" = weakref.WeakSet()  # streams that wrote tensors


def current_stream() -> StandInStream:
    """The stand-in stream work runs on now (``with stream:`` sets it; the default one otherwise)."""
    return _CURRENT[-1]


def _storages(tensors) -> list[int]:
    keys = []
    for t in tensors:
        try:
            keys.append(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # no storage
            continue
    return keys


def _written(func: Any, args: tuple, kwargs: dict, out: Any) -> list[torch.Tensor]:
    """The tensors an op writes: its mutated arguments and its outputs."""
    written = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    schema = getattr(func, "_schema", None)
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def _note_op(stream: StandInStream, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    stream.ops += 1
    if stream is DEFAULT_STREAM:
        return  # the default stream's writes are not tracked: the common case costs nothing more
    for key in _storages(_written(func, args, kwargs, out)):
        stream.written[key] = stream.ops
    if stream.written:
        _WRITERS.add(stream)


class _StreamWrites(TorchDispatchMode):
    """Outside a recording: the ops run under ``with stream:`` count as that stream's, and what they write."""

    def __init__(self, stream: StandInStream) -> None:
        super().__init__()
        self.stream = stream

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        _note_op(self.stream, func, args, kwargs, out)
        return out


class StreamRules:
    """While a step is recorded: the stream and event rules of a CUDA capture, over the stand-ins. The
    recording's stream is the stand-in current when it starts; ``findings()`` after it returns."""

    def __init__(self) -> None:
        self.capture_stream = current_stream()
        self.streams = {self.capture_stream}  # the capturing stream and the side streams it forked
        self._found: list[Finding] = []
        self._reported: set = set()

    def __enter__(self) -> "StreamRules":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)

    def add(self, op: str) -> None:
        if op not in self._reported:  # one finding per rule and op, not per call
            self._reported.add(op)
            self._found.append(_finding(STREAM_ORDER, op))

    def on_wait(self, stream: StandInStream, event: StandInEvent) -> None:
        if stream in self.streams and event.capture is not self:
            self.add(f"{stream!r} waits on an event recorded on {event.stream!r} outside the capture "
                     "(CUDA: cudaErrorStreamCaptureIsolation)")
        elif stream not in self.streams and event.capture is self:
            self.streams.add(stream)  # a fork: the side stream joins the capture

    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """One recorded op, on the current stand-in stream."""
        stream = current_stream()
        if stream not in self.streams:
            self.add(f"{func} runs on {stream!r}, which the capture never forked: it would run at capture only "
                     f"(make {stream!r} wait on the capturing stream first)")
        if _WRITERS:
            reads = set(_storages(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)))
            for writer in list(_WRITERS):
                if writer is not stream and any(writer.written.get(key, 0) > stream.seen.get(writer, 0)
                                                for key in reads):
                    self.add(f"{func} on {stream!r} reads a tensor {writer!r} wrote without waiting for it (wait on "
                             f"that stream's event, e.g. FSDP2's post-reduce event, before the step)")
        _note_op(stream, func, args, kwargs, out)

    def findings(self) -> list[Finding]:
        for side in self.streams - {self.capture_stream}:
            if self.capture_stream.seen.get(side, 0) < side.ops:
                self.add(f"side stream {side!r} is not joined back before the capture ends "
                         f"(CUDA: cudaErrorStreamCaptureUnjoined): {self.capture_stream.name}.wait_stream(side)")
        return list(self._found)
