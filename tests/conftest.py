"""Shared test setup.

The shared helpers live in importable modules next to this file, one copy each:
- ``toy.py``: the small transformer, the deterministic data stream, the per-rank loss and the drift
  metrics of docs/design.md §8 (used by the engine tests and by every spawned rank);
- ``distributed/_harness.py``: spawning gloo ranks on 127.0.0.1 on a free port, bounded in time;
- ``_source.py``: the line a marker stands on in a test's own source (capture's findings name it);
- ``_kernel_pin.py``: ``kernel="auto"`` runs as "fused" in tests not marked ``default_kernel``;
- ``_dispatched.py``: ``DispatchedOps``, the operators a block sends to the dispatcher.

This conftest puts tests/ on ``sys.path`` (pytest does so for a conftest's folder), so ``import toy``
works from tests/distributed too, and ranks spawned from a test inherit that path. It also gives the
engine tests one builder, the ``make_engine`` fixture, and gives CI a deterministic hypothesis profile.
"""

import os

import pytest
from hypothesis import settings

import graphstep as gs
from _kernel_pin import pin_auto_to_fused

# CI (CI=true): the property tests draw the same examples every run and have no per-example deadline, so
# a busy 2-core machine cannot turn them red by chance; locally they keep drawing fresh examples.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _auto_kernel_is_fused_unless_marked(request, monkeypatch):
    # Compiling in every test would cost minutes of CI; the default's own tests are marked (_kernel_pin.py).
    if request.node.get_closest_marker("default_kernel") is None:
        pin_auto_to_fused(monkeypatch.setattr)


@pytest.fixture
def make_engine():
    """``make_engine(model, **config)``: a graphstep optimizer, eager and unclipped unless told otherwise."""

    def build(model, **config):
        config.setdefault("capture", "eager")
        config.setdefault("clip_grad", 0.0)
        return gs.get_optimizer(gs.OptimizerConfig(**config), model)

    return build
