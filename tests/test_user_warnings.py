"""graphstep's warnings name the user's line (graphstep/config/warn.py walks the stack out of graphstep, its
capture layer, torch and the standard library), whatever the depth of the library's calls: eager or captured,
through opt.step() or an Iteration."""

import warnings

import pytest
import torch

import graphstep as gs
from graphstep.iteration import Iteration


def _model():
    # A weight of one 4,096-element row: the folded norm's backward hooks fold it (small_fold_units).
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))


def _caught(fn, match: str):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    found = [w for w in seen if match in str(w.message)]
    assert found, [str(w.message) for w in seen]
    return found[0]


@pytest.mark.parametrize("capture", ["eager", "graph"])
def test_a_step_before_any_backward_is_warned_at_the_users_step_line(capture):
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, capture=capture), _model())
    warning = _caught(lambda: opt.step(), "step() ran before any backward")
    assert warning.filename == __file__


@pytest.mark.small_fold_units
@pytest.mark.parametrize("capture", ["eager", "graph"])
def test_accumulating_outside_no_sync_is_warned_at_the_users_step_line(capture):
    model = _model()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, capture=capture), model)

    def two_backwards_then_step():
        for _ in range(2):
            model(torch.randn(4, 64)).sum().backward()
        opt.step()

    warning = _caught(two_backwards_then_step, "backward ran more than once outside opt.no_sync")
    assert warning.filename == __file__


@pytest.mark.small_fold_units
def test_an_iterations_warning_points_at_the_users_call():
    model = _model()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, capture="graph", capture_warmup_steps=1), model)
    iteration = Iteration(model, opt, lambda model, batch: model(batch).square().mean())
    batch = torch.randn(4, 64)
    for _ in range(3):
        iteration(batch=batch)  # warm-up, capture, replay

    def replace_a_param():
        with torch.no_grad():
            model[0].weight.data = model[0].weight.data.clone()
        iteration(batch=batch)

    warning = _caught(replace_a_param, "the iteration is captured again")
    assert warning.filename == __file__
