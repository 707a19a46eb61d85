"""What capture reports when a step cannot be captured or replayed safely.

A `Finding` is one unsafe thing a step did, located at the user's source line (not
torch's), so the message points at the code to change. `CaptureError` carries every
finding at once: fixing one host sync only to meet the next on the following run is
a slow way to learn about a step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["Finding", "CaptureError", "StaleInputError"]

#: The kinds a Finding can have.
HOST_SYNC = "host_sync"
DEVICE_TO_HOST = "device_to_host"
ESCAPING_TENSOR = "escaping_tensor"
RNG = "rng"
HOST_TO_DEVICE = "host_to_device"  # a copy from host memory into the step's device (pageable: a sync)
HOST_TENSOR = "host_tensor"  # a tensor made from Python data inside the step (torch.tensor(x, ...))
HOST_WORK = "host_work"  # a CPU op inside a step that runs on a device (not part of a device graph)
LAZY_INIT = "lazy_init"  # first-time setup (a compile, a communicator) during the capture
NOT_CAPTURABLE = "not_capturable"  # a torch.optim step whose param groups say capturable=False
TEMPORARY_RESIZE = "temporary_resize"  # a storage resize of a tensor the step itself made (replay backend)
KINDS = (HOST_SYNC, DEVICE_TO_HOST, ESCAPING_TENSOR, RNG, HOST_TO_DEVICE, HOST_TENSOR, HOST_WORK, LAZY_INIT,
         NOT_CAPTURABLE, TEMPORARY_RESIZE)


@dataclass(frozen=True)
class Finding:
    """One thing that makes a step unsafe to capture.

    kind:     "host_sync" | "device_to_host" | "escaping_tensor" | "rng" | "host_to_device" |
              "host_tensor" | "host_work" | "lazy_init" | "not_capturable" | "temporary_resize" (see the
              constants above)
    op:       the operator, e.g. "aten._local_scalar_dense.default" or "Tensor.tolist"
    filename, lineno, line: the innermost user frame (outside torch/ and capture/)
    """

    kind: str
    op: str
    filename: str
    lineno: int
    line: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} at {self.filename}:{self.lineno}: {self.line}"


class CaptureError(Exception):
    """A step cannot be captured (or replayed) as it is; `.findings` says why."""

    def __init__(self, message: str, findings: Iterable[Finding] = ()):
        self.findings = tuple(findings)
        text = message
        if self.findings:
            text += "\n" + "\n".join(f"  {f}" for f in self.findings)
        super().__init__(text)


class StaleInputError(CaptureError):
    """A static input of a captured step was replaced, moved or reshaped."""
