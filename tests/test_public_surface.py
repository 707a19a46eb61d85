"""graphstep's public surface: ``__all__`` is the user API, and the two façades (``get_optimizer``'s engine and
``wrap``'s captured torch optimizer) answer the same questions about their step."""

import torch

import graphstep as gs

INTERNALS = ("Layout", "ParamSpec", "plan_layout", "scaler_from_config")


def test_all_is_the_user_api():
    assert not set(INTERNALS) & set(gs.__all__)
    assert {"get_optimizer", "wrap", "OptimizerConfig", "StepResult", "StepReport", "checkpoint"} <= set(gs.__all__)
    assert all(hasattr(gs, name) for name in gs.__all__)
    from graphstep.plan.layout import Layout, ParamSpec, plan_layout  # internals: from their modules
    from graphstep.step.scaler import scaler_from_config
    assert callable(plan_layout) and callable(scaler_from_config) and Layout and ParamSpec


def _wrapped():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = gs.wrap(torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True), capture="graph")
    for _ in range(3):
        model(torch.ones(4, 16)).sum().backward()
        opt.step()
    return model, opt


def test_both_facades_name_their_capture_backend():
    model = torch.nn.Linear(16, 8)
    engine = gs.get_optimizer(gs.OptimizerConfig(capture="graph", capture_warmup_steps=1), model)
    _, wrapped = _wrapped()
    assert wrapped.captured
    assert wrapped.capture_backend == engine.capture_backend


def test_the_wrapped_optimizers_memory_stats_count_its_params_grads_and_state():
    model, opt = _wrapped()
    stats = opt.memory_stats()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    device = stats["device"]
    assert device["params"] == params
    assert device["grads"] == params  # the static grads the captured step reads
    assert device["exp_avg"] == device["exp_avg_sq"] == params
    assert device["total"] == sum(v for k, v in device.items() if k != "total")
    assert stats["host"] == {"total": 0}
    assert set(gs.get_optimizer(gs.OptimizerConfig(), torch.nn.Linear(2, 2)).memory_stats()) == set(stats)
