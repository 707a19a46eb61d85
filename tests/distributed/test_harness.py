"""The rank spawner itself: ranks forked from the session's fork server still see what a freshly spawned
interpreter would (the caller's environment, working directory and import path at the call), and share no
state with the ranks of an earlier call."""

import os
import sys

import pytest

from _harness import spawn, values

pytestmark = pytest.mark.distributed

_MARK = "graphstep_harness_mark"  # set in one rank's module state to see whether a later rank inherits it


def what_a_rank_sees(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    seen = {"env": os.environ.get("GRAPHSTEP_HARNESS_PROBE"), "cwd": os.getcwd(), "path": list(sys.path),
            "pid": os.getpid(), "inherited": getattr(sys, _MARK, None), "world": dist.get_world_size()}
    setattr(sys, _MARK, rank)
    return seen


def test_ranks_see_the_callers_environment_directory_and_path_and_nothing_of_earlier_ranks(monkeypatch, tmp_path):
    first = values(spawn(what_a_rank_sees, 2))
    monkeypatch.setenv("GRAPHSTEP_HARNESS_PROBE", "set after the fork server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    second = values(spawn(what_a_rank_sees, 2))
    assert [r["env"] for r in first] == [None, None]
    assert [r["env"] for r in second] == ["set after the fork server started"] * 2
    assert {r["cwd"] for r in second} == {str(tmp_path)}
    assert all(r["path"] == sys.path for r in second)
    assert [r["inherited"] for r in first + second] == [None] * 4  # each rank a fresh process
    assert len({r["pid"] for r in first + second}) == 4 and {r["world"] for r in first + second} == {2}
