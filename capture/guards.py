"""Static-input guards: catch a replaced tensor before a replay reads stale memory.

A captured step (a CUDA graph, or the replay backend's op list) holds raw addresses.
If someone swaps `param.data`, reallocates a buffer or resizes it, the Python objects
may look the same (a Parameter keeps its identity when `.data` is swapped) but the
graph still reads and writes the old memory: results silently stop reaching the
model. So before every replay we compare each static input's data_ptr, shape, stride,
dtype and device with what they were at capture, and refuse to replay on any change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

import torch

from .errors import StaleInputError

__all__ = ["StaticInputs", "TensorSignature", "StaticInputGuard"]

StaticInputs = Union[Mapping[str, torch.Tensor], Callable[[], Mapping[str, torch.Tensor]]]

DEFAULT_HINT = "call invalidate() (or the owner's recapture()) after replacing tensors"


@dataclass(frozen=True)
class TensorSignature:
    """Everything about a tensor that a captured step has baked in."""

    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSignature":
        return cls(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    def differences(self, now: "TensorSignature") -> list[str]:
        """Human-readable list of what changed from self (capture) to now."""
        out = []
        if self.data_ptr != now.data_ptr:
            out.append(f"moved (0x{self.data_ptr:x} -> 0x{now.data_ptr:x})")
        for field in ("shape", "stride", "dtype", "device"):
            old, new = getattr(self, field), getattr(now, field)
            if old != new:
                out.append(f"changed {field} {old} -> {new}")
        return out


class StaticInputGuard:
    """Records static inputs at capture; `verify()` raises StaleInputError on change.

    `static_inputs` is a mapping name -> tensor, or a zero-argument callable returning
    one; a callable is re-evaluated at every check, so it can follow attributes that
    may be rebound (`lambda: {"grad_flat": opt.grad_flat}`).
    """

    def __init__(self, static_inputs: StaticInputs, *, stale_hint: Optional[str] = None):
        self._source = static_inputs
        self._hint = stale_hint or DEFAULT_HINT
        self._recorded: Optional[dict[str, TensorSignature]] = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The current static inputs (evaluating the callable if one was given)."""
        inputs = self._source() if callable(self._source) else self._source
        if not isinstance(inputs, Mapping):
            raise TypeError(f"static_inputs must be a Mapping[str, Tensor], got {type(inputs).__name__}")
        for name, t in inputs.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"static input {name!r} is a {type(t).__name__}, not a Tensor")
        return dict(inputs)

    def snapshot(self) -> dict[str, TensorSignature]:
        return {name: TensorSignature.of(t) for name, t in self.tensors().items()}

    def record(self) -> None:
        """Remember the inputs as they are now (call at capture)."""
        self._recorded = self.snapshot()

    def clear(self) -> None:
        self._recorded = None

    def verify(self, *, hint: Optional[str] = None) -> None:
        """Raise StaleInputError naming every input that differs from the recording.

        `hint` replaces the advice at the end of the message for this one check.
        """
        if self._recorded is None:
            return
        now = self.snapshot()
        problems = []
        for name, old in self._recorded.items():
            if name not in now:
                problems.append(f"static input {name!r} is gone")
                continue
            diffs = old.differences(now[name])
            if diffs:
                problems.append(f"static input {name!r} " + " and ".join(diffs))
        for name in now.keys() - self._recorded.keys():
            problems.append(f"static input {name!r} was not there at capture")
        if problems:
            raise StaleInputError(
                "; ".join(problems) + f": the captured step would read the old memory; {hint or self._hint}"
            )
