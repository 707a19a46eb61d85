"""The step's scalar math compiled (graphstep/step/compiled_scalar_math.py) against the same math run op by op: bitwise,
over the values that decide a step (no clip, clipped, over the skip threshold, non-finite), one operator
to the dispatcher, every value read live."""

import itertools

import pytest
import torch
from _dispatched import DispatchedOps

from graphstep.step import compiled_scalar_math
from graphstep.step.scaler import MAX_LOSS_SCALE, DynamicLossScaler
from graphstep.step.stages import clip, norm

F32, F64 = torch.float32, torch.float64
NORMS = [0.0, 1e-30, 0.3, 1.0, 7.5, 3e38, float("inf"), float("nan")]


def scalars(*values, dtype=F32):
    return [torch.tensor(v, dtype=dtype) for v in values]


def run_both(graph, outs, ins):
    """``graph`` run op by op and compiled on copies of the same outs: both results."""
    results = []
    for compiled in (False, True):
        written = [o.clone() for o in outs]
        graph(written, ins, compiled=compiled)
        results.append(written)
    return results


def assert_bitwise(eager, compiled):
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all()), (a, b)


@pytest.mark.parametrize("grad_norm", NORMS)
def test_clip_compiled_is_bitwise_the_eager_math(grad_norm):
    for clip_grad, skip, inv_scale, found in itertools.product((0.0, 1.0, 2.5), (1e9, 5.0), (1.0, 2.0 ** -12),
                                                              (0.0, 1.0)):
        outs = scalars(1.0, found, 1.0)  # clip_coef, found_inf, grad_scale
        ins = scalars(grad_norm) + scalars(clip_grad, skip, dtype=F64) + scalars(inv_scale, 1.0)
        eager, compiled = run_both(clip._CLIP, outs, ins)
        assert_bitwise(eager, compiled)
    # The values move: clipped below 1 and skipped over the threshold (a broken graph writing nothing fails).
    outs = scalars(1.0, 0.0, 1.0)
    clip._CLIP(outs, scalars(7.5) + scalars(1.0, 5.0, dtype=F64) + scalars(1.0, 1.0), compiled=True)
    assert 0 < outs[0] < 1 and outs[1] == 1.0 and outs[2] == 1 / outs[0]


@pytest.mark.parametrize("sumsq", [0.0, 1e-300, 2.25, 1e40, float("inf"), float("nan")])
def test_norm_result_compiled_is_bitwise_the_eager_math(sumsq):
    outs = scalars(0.0, 0.0, 0.0)  # nonfinite, found_inf, grad_norm
    eager, compiled = run_both(norm._RESULT, outs, scalars(sumsq, dtype=F64) + scalars(0.5))
    assert_bitwise(eager, compiled)
    assert compiled[0] == (0.0 if sumsq < float("inf") else 1.0) and torch.equal(compiled[1], compiled[0])


def test_dynamic_loss_scale_compiled_follows_the_eager_rule_bitwise_step_by_step():
    # Growth every 2 clean steps up to the cap, backoff after 3 non-finite ones down to the floor.
    pattern = [0] * 12 + [1] * 9 + [0, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    scalers = [DynamicLossScaler(2.0 ** 124, min_scale=2.0 ** 121, growth_interval=2, hysteresis=3, device="cpu",
                                 growth_factor=2.0, backoff_factor=0.5) for _ in range(2)]
    seen = set()
    for bad in pattern:
        for scaler, compiled in zip(scalers, (False, True)):
            scaler.update(torch.tensor(float(bad)), compiled=compiled)
        eager, compiled = (s.state_dict() | {"inv_scale": s.inv_scale} for s in scalers)
        for key in eager:
            assert torch.equal(eager[key], compiled[key]), (key, eager[key], compiled[key])
        seen.add(float(scalers[1].scale))
    assert {MAX_LOSS_SCALE, 2.0 ** 121} <= seen  # reached the cap and the floor


def test_each_compiled_scalar_graph_is_one_operator_and_reads_its_inputs_live():
    outs = scalars(1.0, 0.0, 1.0)
    clip_grad = torch.tensor(1.0, dtype=F64)
    ins = scalars(4.0) + [clip_grad] + scalars(1e9, dtype=F64) + scalars(1.0, 1.0)
    with DispatchedOps() as ops:
        clip._CLIP(outs, ins, compiled=True)
    assert ops.names.count("graphstep.scalar_graph_.default") == 1
    assert not any(name.startswith("aten.") and "view" not in name for name in ops.names)
    coefficients = []
    for value in (1.0, 2.0, 0.0):  # clip_grad changed in place between calls: never frozen
        clip_grad.fill_(value)
        clip._CLIP(outs, ins, compiled=True)
        coefficients.append(float(outs[0]))
    assert coefficients == [pytest.approx(1.0 / (4.0 + 1e-6)), pytest.approx(2.0 / (4.0 + 1e-6)), 1.0]


def test_a_scalar_graph_name_is_registered_once():
    with pytest.raises(ValueError, match="registered already"):
        compiled_scalar_math.register("clip", lambda outs, ins: None)


def test_the_compile_preflight_compiles_a_division_and_reports_missing_options(monkeypatch):
    # perf/gpu_check.py's preflight: what the step would compile at its first call, found before it.
    assert compiled_scalar_math.compile_problem(torch.device("cpu")) is None
    monkeypatch.setattr(compiled_scalar_math, "COMPILE_OPTIONS", {**compiled_scalar_math.COMPILE_OPTIONS, "no_such.option": True})
    assert compiled_scalar_math.compile_problem(torch.device("cpu")) == "inductor has no option no_such.option"
