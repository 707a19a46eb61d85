"""A damaged checkpoint on disk, reported as ``CheckpointError`` naming the file and what is wrong.

DCP reports damage in its own terms: an unpickler's raw error naming no file, or a ``CheckpointException``
(a ``BaseException`` that escapes a resume path's ``except Exception``). graphstep turns each into a
``CheckpointError`` (a ``ValueError``) chained to the original, before anything is copied into the
optimizer. ``state_value_problem`` judges a saved state tensor's values: what torch's own arithmetic can
leave in that state is a state, anything else is corruption.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

_RESTORE = "copy the checkpoint again from where it came from, or load an earlier one"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, damaged, unsafe, of another model or format version).
    The message names the file or directory; ``__cause__`` holds the underlying error where there is one."""


def metadata_error(path: Any, err: BaseException) -> CheckpointError:
    """The ``.metadata`` file at ``path`` could not be read (``err``): empty, truncated or garbage."""
    if isinstance(err, FileNotFoundError):
        return CheckpointError(f"{path}: missing: not a DCP checkpoint, or a save that never committed; "
                               f"{_RESTORE}")
    try:
        size = os.path.getsize(path)
    except OSError:
        size = None
    if size == 0:
        return CheckpointError(f"{path}: the checkpoint's metadata file is empty (0 bytes): its write never "
                               f"finished or the file was truncated; {_RESTORE}")
    return CheckpointError(f"{path}: the checkpoint's metadata file is damaged ({size} bytes that do not "
                           f"unpickle as DCP metadata: {type(err).__name__}: {err}); it is truncated or "
                           f"overwritten; {_RESTORE}")


def _inside(relative_path: Any) -> bool:
    return isinstance(relative_path, str) and bool(relative_path) and not os.path.isabs(relative_path) and \
        not os.path.normpath(relative_path).startswith(os.pardir)


def _needed_sizes(metadata, directory: str) -> dict[str, int]:
    """{data file name: the number of bytes the metadata says it holds at least}."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{os.path.join(directory, '.metadata')}: lists no data files (not written by "
                              "DCP's FileSystemWriter?); graphstep loads checkpoints written by gs.checkpoint.save")
    needed: dict[str, int] = {}
    for info in storage.values():
        name, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if not _inside(name) or not isinstance(offset, int) or not isinstance(length, int) or min(offset, length) < 0:
            raise CheckpointError(f"{os.path.join(directory, '.metadata')}: lists a data file {name!r:.80} at "
                                  f"bytes {offset!r:.20}+{length!r:.20}, which is not a file range inside the "
                                  f"checkpoint directory: the metadata is damaged; {_RESTORE}")
        needed[name] = max(needed.get(name, 0), offset + length)
    return needed


def check_data_files(metadata, directory: str) -> None:
    """Every data file ``metadata`` lists exists in ``directory`` and is long enough; else CheckpointError.

    Sizes only (a stat per file, no read): every rank checks every file, so all ranks decide alike."""
    for name, size in sorted(_needed_sizes(metadata, directory).items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing: the checkpoint's metadata lists this data file (a partial "
                                  f"copy of the checkpoint directory?); {_RESTORE}")
        actual = os.path.getsize(path)
        if actual == 0:
            raise CheckpointError(f"{path}: the data file is empty (0 bytes; the metadata lists {size}): its "
                                  f"write never finished or the file was truncated; {_RESTORE}")
        if actual < size:
            raise CheckpointError(f"{path}: the data file is truncated ({actual} bytes; the metadata says its "
                                  f"data reach byte {size}); {_RESTORE}")


def data_error(path: Any, err: BaseException) -> CheckpointError:
    """Reading the data file at ``path`` failed with ``err`` (its bytes do not decode as saved tensors)."""
    if isinstance(err, FileNotFoundError):
        return CheckpointError(f"{path}: missing: the checkpoint's metadata lists this data file; {_RESTORE}")
    # The type only: torch.load's message advises weights_only=False, the wrong cure for a damaged file.
    return CheckpointError(f"{path}: the data file is damaged (its bytes do not decode as the tensors the "
                           f"metadata lists: {type(err).__name__}, chained below); {_RESTORE}")


def from_dcp_failure(exc: BaseException, directory: str) -> CheckpointError:
    """A ``CheckpointError`` for DCP's ``CheckpointException`` ``exc``: the first rank's own
    ``CheckpointError`` where one raised it, else one naming ``directory`` and the first failure."""
    failures = getattr(exc, "failures", {}) or {}
    errors = [failures[rank][0] for rank in sorted(failures)]
    for err in errors:
        if isinstance(err, CheckpointError):
            return err  # already names the file; its __cause__ (on the rank that raised it) is the original
    first = errors[0] if errors else exc
    error = CheckpointError(f"{directory}: DCP could not load this checkpoint ({type(first).__name__}: "
                            f"{str(first)[:300]}); {_RESTORE}")
    error.__cause__ = first
    return error


def state_value_problem(value: torch.Tensor, *, second_moment: bool = False) -> Optional[str]:
    """What makes the values of a saved optimizer state (or main params) ``value`` impossible, or None.

    Decided per kind of state by what torch.optim's arithmetic can put there from finite grads:

    - a second moment (``second_moment``: Adam's and AdEMAMix's ``exp_avg_sq``, ``StateSpec.nonnegative``) is
      ``β2·v + (1 − β2)·g²``: never negative and never NaN, but ``g²`` overflows fp32 for a finite grad above
      about 1.8e19 (a grad of 1e30 without clipping), and torch keeps that ``+inf`` while its params stay
      finite (the update ``m / (√v + ε)`` is then 0). A state, loaded as it is: refusing it would make
      graphstep refuse its own checkpoint. NaN, ``-inf`` and negative values are refused.
    - anything else (main params, first moments, momentum buffers, slow EMAs) is a convex combination or a sum
      of finite grads and params, finite as long as the params are: inf or NaN there comes with params that
      are no longer finite, and is refused as corruption.
    """
    if not value.is_floating_point() or value.numel() == 0:
        return None
    if value.element_size() == 1:  # fp8: no reduction kernels; fp32 holds every fp8 value exactly
        value = value.to(torch.float32)
    total = value.sum()  # one fast reduction: a finite sum proves every element finite
    if bool(torch.isfinite(total)):
        return "holds negative values (a second moment is never negative)" \
            if second_moment and bool(value.min() < 0) else None
    if bool(torch.isnan(value).any()):
        return "holds NaN or inf (NaN): refusing to load a corrupted checkpoint"
    if not second_moment:
        if bool(torch.isinf(value).any()):
            return ("holds NaN or inf (inf, which only a second moment may hold): refusing to load a corrupted "
                    "checkpoint")
        return None  # finite elements whose sum overflowed
    if bool(value.min() < 0):
        return "holds negative values or -inf (a second moment is never negative)"
    return None
