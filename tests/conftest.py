"""Shared test setup.

The shared helpers live in importable modules next to this file, one copy each:
- ``toy.py``: the small transformer, the deterministic data stream, the per-rank loss and the drift
  metrics of docs/design.md §8 (used by the engine tests and by every spawned rank);
- ``_engine.py``: ``make_engine(model, **config)``, the one engine builder (eager unless told otherwise);
- ``_ports.py``: ``free_port()``, the one free-port lookup for a gloo rendezvous on 127.0.0.1;
- ``distributed/_harness.py``: ``spawn``, the one way a test starts gloo ranks, bounded in time;
- ``_source.py``: the line a marker stands on in a test's own source (capture's findings name it);
- ``_auto_kernel.py``: the default kernel's verdict as tests check it (``auto_as_large``);
- ``_dispatched.py``: ``DispatchedOps``, the operators a block sends to the dispatcher.

This conftest puts tests/ on ``sys.path`` (pytest does so for a conftest's folder), so ``import toy``
works from tests/distributed too, and tests/distributed, so ``from _harness import spawn`` works from
tests/ too; ranks spawned from a test inherit that path. Every test that spawns ranks is marked
``distributed``: ``python -m pytest -q -m "not distributed"`` is the fast loop. This conftest also gives
CI a deterministic hypothesis profile.
"""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.append(str(Path(__file__).parent / "distributed"))

# CI (CI=true): the property tests draw the same examples every run and have no per-example deadline, so
# a busy 2-core machine cannot turn them red by chance; locally they keep drawing fresh examples.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _auto_kernel_judges_small_as_large_where_marked(request, monkeypatch):
    # Tests run kernel="auto" for real: their small models run "fused", as a user's do. Tests of the compiled
    # choice mark themselves ``auto_as_large``: their model stands for a large one, and "auto" probes afresh in
    # this process (a verdict remembered on the machine would skip their probes).
    if request.node.get_closest_marker("auto_as_large") is not None:
        from graphstep.kernels import auto

        monkeypatch.setattr(auto, "COMPILE_MIN_NUMEL", 0)
        monkeypatch.setattr(auto, "verdict_file", lambda: None)


@pytest.fixture(autouse=True)
def _fold_units_of_one_row_where_marked(request, monkeypatch):
    # Tests run the folded norm's real unit sizes, at which a test model's params are too small to be folded
    # in backward (the step folds them). Tests of the backward fold itself mark themselves ``small_fold_units``:
    # units of one row, every param folded by hooks, as large models' params are.
    if request.node.get_closest_marker("small_fold_units") is not None:
        from graphstep.step import folded_sums

        monkeypatch.setattr(folded_sums, "UNIT_ROWS", 1)
        monkeypatch.setattr(folded_sums, "HOOK_MIN_ELEMENTS", 1)


@pytest.fixture
def one_thread():
    """One intra-op thread for a test: the tiny models' ops are too small to gain from a second one, and when
    another job holds the other core (CI, a shared machine) two threads wait on each other for many times the
    step time."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-process gloo group for a module's tests: what FSDP2's fully_shard and torch's checkpoint API need to
    run at all. Destroyed after the module (left alone if something else made one)."""
    import torch.distributed as dist

    from _ports import free_port
    if dist.is_initialized():
        yield
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
