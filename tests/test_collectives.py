"""graphstep/parallel/collectives.py's choices that need no process group to check."""

import datetime

import torch.distributed as dist

from graphstep.parallel import teardown
from graphstep.parallel.collectives import derive_group


def test_an_nccl_group_is_used_as_it_is_and_a_gloo_group_gets_a_copy_with_the_timeout(monkeypatch):
    # A copy of an NCCL group is a second communicator (buffers on every GPU, set-up time) that bounds nothing:
    # the step runs on the user's NCCL group; a gloo copy carries distributed_timeout_s (a bounded error).
    made = []
    monkeypatch.setattr(dist, "get_backend", lambda group: group)  # the stand-in group is its backend's name
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(dist, "new_group", lambda ranks, **options: made.append((ranks, options)) or "copy")
    assert derive_group("nccl", 5.0) == "nccl" and made == []
    assert derive_group("gloo", 5.0) == "copy"
    assert made == [([0, 1], {"timeout": datetime.timedelta(seconds=5.0), "backend": "gloo",
                              "use_local_synchronization": True})]


def test_destroying_a_group_releases_the_captured_steps_on_it_and_destroying_all_releases_every_one():
    class Step:
        def __init__(self):
            self.closed = False

        def close(self):
            self.closed = True

    on_a, on_b, on_both = Step(), Step(), Step()
    group_a, group_b = object(), object()  # stand-ins: release compares groups by identity
    for step, groups in ((on_a, [group_a]), (on_b, [group_b]), (on_both, [group_a, group_b])):
        teardown.release_before_teardown(step, groups)
    teardown.release(group_a)
    assert (on_a.closed, on_b.closed, on_both.closed) == (True, False, True)
    teardown.release()  # the whole job
    assert on_b.closed
