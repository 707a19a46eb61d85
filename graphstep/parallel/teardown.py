"""Captured steps are released before the process groups whose collectives they captured.

From NCCL 2.26 on, destroying a communicator waits until every CUDA graph that captured one of its collectives
is destroyed, so ``destroy_process_group()`` while an optimizer holds its captured step never returns. A step
that captures collectives registers here and is closed (any later step runs eagerly) by ``opt.close()`` or
leaving ``with opt:``, at the start of ``torch.distributed.destroy_process_group`` (wrapped on the first
registration; a reference imported before bypasses it), or at interpreter exit.
"""

from __future__ import annotations

import atexit
import functools
import weakref
from typing import Iterable, Optional

import torch.distributed as dist

_registered: "weakref.WeakKeyDictionary[object, tuple]" = weakref.WeakKeyDictionary()  # owner -> its groups
_wrapped = False


def release_before_teardown(owner, groups: Iterable[dist.ProcessGroup]) -> None:
    """Close ``owner`` (anything with ``close()``, held weakly) before any of ``groups`` is destroyed."""
    _registered[owner] = tuple(groups)
    _wrap_destroy_once()


def release(group: Optional[dist.ProcessGroup] = None) -> None:
    """Close every registered owner whose collectives run on ``group``; all of them for None or the default
    group, whose destruction takes every group with it."""
    everything = group is None or group is dist.GroupMember.WORLD
    for owner, groups in list(_registered.items()):
        if everything or any(g is group for g in groups):
            _registered.pop(owner, None)
            owner.close()


def _wrap_destroy_once() -> None:
    global _wrapped
    if _wrapped:
        return
    _wrapped = True
    original = dist.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Optional[dist.ProcessGroup] = None, *args, **kwargs):
        release(group)
        return original(group, *args, **kwargs)

    dist.destroy_process_group = destroy_process_group
    atexit.register(release)
