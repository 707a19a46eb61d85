"""The replay backend's rules for what a CUDA capture would refuse that a plain op recorder would not.

docs/design.md §9: the CPU replay backend is the strict twin of a CUDA graph. The op-level rules (host
syncs, device-to-host and host-to-device copies, tensors made from Python data, undeclared RNG) are
classified in `capture.unsafe`; this module holds the rules that need more context than one op:

* **Host work inside a device step.** A CUDA graph records device work only. An op whose tensors all
  live on the CPU inside a step that runs on a device is run once, at capture, and never replayed; a
  CPU tensor read by a device op (a 0-d "scalar" tensor) has its capture-time value baked into the
  kernel's arguments. The replay backend would replay both faithfully, so it refuses them instead.
  Which device a step runs on is only known once it has run: the first non-CPU tensor any recorded op
  touches decides; in a CPU-only step the host *is* the device and this rule is silent (the
  CPU-only analogue is the `host_tensor` rule in `capture.unsafe`: a tensor made from Python data).
* **Lazy initialisation during the recording** (`LazyInitWatch`): work that a CUDA capture cannot
  contain because it synchronises or allocates outside the graph.
  - A torch.compile (dynamo) compilation that starts while recording: Inductor compiles, benchmarks
    and autotunes with host syncs. Detected with dynamo's compile-start callback.
  - The first collective on a process group, c10d or functional (``_c10d_functional``, which names
    its group by a string): NCCL creates its communicator lazily, on a group's first collective
    (unless the group was bound to a device at init), and that setup cannot be captured. Detected
    from the group's collective sequence number, which is 0 until the group has run a collective
    (ProcessGroup._get_sequence_number_for_group, gloo and NCCL).
  Not detected (documented instead): cuBLAS/cuDNN handle and workspace creation, allocator growth,
  Triton kernels compiled outside dynamo, a torch.compile'd function called *directly* inside the
  step (dynamo does not run under a TorchDispatchMode, so it runs eagerly during the recording: wrap
  compiled kernels in a `torch.library` custom op, as graphstep does, to record them as one op).
* **torch.optim's capture health check** (`OptimizerCaptureCheck`). Adam, AdamW and the other
  optimizers whose step calls `Optimizer._accelerator_graph_capture_health_check` raise when the
  current CUDA (or XPU) stream is capturing and a param group has `capturable=False`; `fused=True`
  gets no exemption. On a CPU build the check returns at once (no accelerator), so while recording
  it is swapped for one that applies the accelerator's rule to any device.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_leaves

from .. import _location
from ..errors import HOST_WORK, LAZY_INIT, NOT_CAPTURABLE, Finding

__all__ = ["LazyInitWatch", "OptimizerCaptureCheck", "first_use_groups", "DeviceStepRule"]

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
