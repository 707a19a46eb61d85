"""Bitwise parity assertions whose failure says where and by how much: the tensor's name, the step, and the
distance in ulps (units in the last place of the tensors' dtype).

A bitwise claim against a torch CPU kernel holds on every vector width only where the sizes are multiples of
16 (docs/design.md §8): when one fails on another machine, the message must tell a last-bit rounding of a
kernel's scalar tail (1 ulp, a few elements) from a wrong update (many ulps, many elements).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

_ORDERED_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise distance of two float tensors of one dtype in ulps of that dtype (int64): how many
    representable values lie between them; 0 for +0 and -0. NaN or inf elements give large, meaningless
    distances (the message shows their values too)."""
    as_int = _ORDERED_INT[a.element_size()]
    bits = a.element_size() * 8

    def ordered(x: torch.Tensor) -> torch.Tensor:
        # The float's bits as a signed integer, negative floats mirrored below zero: consecutive floats are
        # consecutive integers.
        raw = x.detach().contiguous().view(as_int).to(torch.int64)
        magnitude = raw & ((1 << (bits - 1)) - 1)
        return torch.where(raw < 0, -magnitude, magnitude)

    return (ordered(a) - ordered(b)).abs()


def bitwise_difference(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> Optional[str]:
    """None where ``ours`` and ``theirs`` are ``torch.equal``, else one line saying how they differ."""
    if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
        return f"{name}: {ours.dtype} {tuple(ours.shape)} against {theirs.dtype} {tuple(theirs.shape)}"
    if torch.equal(ours, theirs):
        return None
    ours, theirs = ours.detach().reshape(-1), theirs.detach().reshape(-1)
    differ = ours.ne(theirs)  # NaN against NaN differs here as it does for torch.equal
    count = int(differ.sum())
    first = int(differ.nonzero()[0, 0])
    if ours.is_floating_point():
        distance = ulps_apart(ours, theirs)
        return (f"{name}: {count} of {ours.numel()} elements differ, at most {int(distance.max())} ulps apart "
                f"(first at flat index {first}: {ours[first].item()!r} against {theirs[first].item()!r}, "
                f"{int(distance[first])} ulps)")
    return (f"{name}: {count} of {ours.numel()} elements differ (first at flat index {first}: "
            f"{ours[first].item()!r} against {theirs[first].item()!r})")


def assert_bitwise(named_ours: Iterable[tuple[str, torch.Tensor]], theirs: Iterable[torch.Tensor], *,
                   step=None, against: str = "torch") -> None:
    """Each of ``named_ours`` (name, tensor) ``torch.equal`` to its partner in ``theirs``; the failure lists
    every tensor that differs, with ``step`` (when given) and the distance in ulps."""
    named_ours, theirs = list(named_ours), list(theirs)
    assert len(named_ours) == len(theirs), f"{len(named_ours)} tensors against {len(theirs)}"
    problems = [p for (name, a), b in zip(named_ours, theirs) if (p := bitwise_difference(name, a, b))]
    where = "" if step is None else f" at step {step}"
    assert not problems, f"not bitwise equal to {against}{where}:\n  " + "\n  ".join(problems)
