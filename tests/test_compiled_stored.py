"""The compiled kernel over state stored below fp32 (graphstep/kernels/compiled_stored.py) against the eager path it
replaces (fp32 windows: decode each chunk into fp32, the compiled Adam, encode back), bitwise: every param, stored
byte and scale after every step, skipped steps, overflowing and tiny moments, odd sizes and capture included.

The eager reference is the same engine with ``stored_kernel.build`` answering None, which sends the group through
the fp32 windows. Sizes: pieces of odd lengths (37, 5 elements) with padding pieces between them, rows cut at
piece boundaries and (n, 1) tails.
"""

import pytest
import torch

import graphstep as gs
from graphstep.step.stages import stored_kernel

SETTINGS = {
    "bf16-moments": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "fp16-moments": dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16),
    "fp8-moments": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    "fp8-bf16-coupled-clipped": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.bfloat16,
                                     decoupled_weight_decay=False, clip_grad=1.0),
    "remainders-bf16": dict(bf16=True, store_param_remainders=True, exp_avg_dtype=torch.bfloat16,
                            exp_avg_sq_dtype=torch.bfloat16),
    "remainders-fp8-fp16": dict(bf16=True, store_param_remainders=True, exp_avg_dtype=torch.uint8,
                                exp_avg_sq_dtype=torch.float16, clip_grad=1.0),
    "fp16-main": dict(bf16=True, main_params_dtype=torch.float16, store_param_remainders=False),
}


def _model(setting):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.ReLU(), torch.nn.Linear(37, 5))
    return model.to(torch.bfloat16) if SETTINGS[setting].get("bf16") else model


def _optimizer(model, setting, **extra):
    config = dict(lr=1e-2, adam_eps=1e-8, weight_decay=0.01, clip_grad=0.0, kernel="compiled", capture="eager",
                  use_precision_aware_optimizer=True)
    return gs.get_optimizer(gs.OptimizerConfig(**{**config, **SETTINGS[setting], **extra}), model)


def _grads(model, step):
    torch.manual_seed(100 + step)
    dtype = next(model.parameters()).dtype
    model(torch.randn(8, 16, dtype=dtype)).float().square().mean().backward()


def _main_grad(param):
    return param.main_grad if param.dtype == torch.bfloat16 else param.grad


def _snapshot(model, opt):
    """Every param, stored byte and scale, and every main param and moment kept in fp32."""
    stored = [(s.data.view(torch.uint8).clone(), None if s.scales is None else s.scales.clone())
              for per_buffer in opt.buffers.stored.values() for s in per_buffer if s is not None]
    plain = [t.view(torch.uint8).clone() for t in opt.buffers.main_shard]
    plain += [t.view(torch.uint8).clone() for per_buffer in opt.buffers.state.values() for t in per_buffer]
    return [p.detach().clone() for p in model.parameters()], stored, plain


def _assert_same(a, b, what):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y), f"{what}: params differ"
    for (x, xs), (y, ys) in zip(a[1], b[1]):
        assert torch.equal(x, y), f"{what}: stored bytes differ"
        assert (xs is None and ys is None) or torch.equal(xs, ys), f"{what}: scales differ"
    for x, y in zip(a[2], b[2]):
        assert torch.equal(x, y), f"{what}: main params or fp32 state differ"


def _run(model, opt, steps, *, skip_at=(), scale_at=None):
    """``steps`` steps; a step in ``skip_at`` gets an inf grad (skipped); ``scale_at(step)``: factor on the grads."""
    snapshots = []
    for step in range(steps):
        opt.zero_grad()
        _grads(model, step)
        first = next(model.parameters())
        if scale_at is not None:
            for p in model.parameters():
                _main_grad(p).mul_(scale_at(step))
        if step in skip_at:
            _main_grad(first).view(-1)[3] = float("inf")
        opt.step()
        snapshots.append(_snapshot(model, opt))
    return snapshots


def _eager_windows(monkeypatch):
    monkeypatch.setattr(stored_kernel, "build", lambda *args, **kwargs: None)


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_compiled_stored_kernel_is_the_eager_windows_path_bitwise(setting, monkeypatch):
    model = _model(setting)
    opt = _optimizer(model, setting)
    assert any(built is not None for built in _BUILT), "the compiled stored-state kernel was not chosen"
    ours = _run(model, opt, 6, skip_at=(3,))
    _eager_windows(monkeypatch)
    reference_model = _model(setting)
    reference = _optimizer(reference_model, setting)
    theirs = _run(reference_model, reference, 6, skip_at=(3,))
    for step, (a, b) in enumerate(zip(ours, theirs)):
        _assert_same(a, b, f"{setting}, step {step}")


_BUILT = []  # what stored_kernel.build gave in this test


@pytest.fixture(autouse=True)
def _record_builds(monkeypatch):
    _BUILT.clear()
    build = stored_kernel.build

    def recording(*args, **kwargs):
        _BUILT.append(build(*args, **kwargs))
        return _BUILT[-1]

    monkeypatch.setattr(stored_kernel, "build", recording)


@pytest.mark.parametrize("setting", ["fp16-moments", "fp8-moments", "remainders-fp8-fp16"])
def test_overflowing_and_tiny_moments_are_stored_as_the_eager_path_stores_them(setting, monkeypatch):
    # Grads of 1e30 (exp_avg_sq overflows to inf) and 1e-30 (scales below the smallest normal fp32) on steps 1-2.
    def scale_at(step):
        return {1: 1e30, 2: 1e-30}.get(step, 1.0)

    kwargs = dict(clip_grad=0.0)
    model = _model(setting)
    ours = _run(model, _optimizer(model, setting, **kwargs), 5, scale_at=scale_at, skip_at=(4,))
    _eager_windows(monkeypatch)
    reference_model = _model(setting)
    theirs = _run(reference_model, _optimizer(reference_model, setting, **kwargs), 5, scale_at=scale_at,
                  skip_at=(4,))
    for step, (a, b) in enumerate(zip(ours, theirs)):
        _assert_same(a, b, f"{setting}, step {step}")


@pytest.mark.parametrize("setting", ["fp8-moments", "remainders-fp8-fp16", "fp16-main"])
def test_captured_steps_equal_eager_steps_bitwise(setting):
    eager_model, graph_model = _model(setting), _model(setting)
    eager = _optimizer(eager_model, setting)
    graph = _optimizer(graph_model, setting, capture="graph", capture_warmup_steps=1)
    a = _run(eager_model, eager, 5, skip_at=(3,))
    b = _run(graph_model, graph, 5, skip_at=(3,))
    assert graph.captured
    for step, (x, y) in enumerate(zip(a, b)):
        _assert_same(x, y, f"{setting}, step {step}")


def test_row_widths_keep_one_piece_boundary_per_row():
    assert stored_kernel._width([0, 37, 64], 128) == 64
    assert stored_kernel._width([0, 10, 20, 64], 128) == 16  # 10 and 20 share a row of 32
    first, second, split = stored_kernel._row_index([0, 37, 64, 101], 0, 128, 64, "cpu")
    assert first.tolist() == [0, 2] and second.tolist() == [1, 3] and split.tolist() == [37, 37]
