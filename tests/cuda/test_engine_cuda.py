"""The engine on a GPU: CUDA-graph replay against eager, bitwise (skipped without an NVIDIA GPU)."""

import pytest
import torch

import graphstep as gs

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).cuda()


def run(mode, precision, steps=40, kernel="fused"):
    model = tiny_model()
    extra = {"bf16": {"bf16": True}, "fp16": {"fp16": True, "initial_loss_scale": 2.0**10}}.get(precision, {})
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, clip_grad=0.5, capture=mode, capture_warmup_steps=3,
                                              kernel=kernel, **extra), model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    g = torch.Generator(device="cuda").manual_seed(0)
    for step in range(steps):
        x = torch.randn(16, 64, device="cuda", generator=g)
        opt.zero_grad()
        opt.scale_loss(model(x.to(next(model.parameters()).dtype)).float().square().mean()).backward()
        if step == 17:
            next(model.parameters()).main_grad.view(-1)[0] = float("inf")
        opt.step()
        sched.step()
    torch.cuda.synchronize()
    return model, opt


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_graph_replay_is_bitwise_equal_to_eager(precision):
    eager_model, _ = run("eager", precision)
    graph_model, graph_opt = run("graph", precision)
    assert graph_opt.captured and graph_opt.capture_backend == "cuda"
    for a, b in zip(eager_model.parameters(), graph_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_kernel_in_a_cuda_graph_is_bitwise_equal_to_eager(precision):
    # The Triton loop is compiled in the eager warm-up, then launched inside the captured graph.
    eager_model, _ = run("eager", precision, kernel="compiled")
    graph_model, graph_opt = run("graph", precision, kernel="compiled")
    assert graph_opt.captured and graph_opt.capture_backend == "cuda" and graph_opt._runner.recaptures == 0
    for a, b in zip(eager_model.parameters(), graph_model.parameters()):
        assert torch.equal(a, b)


def test_auto_captures_on_cuda():
    model, opt = run("auto", "bf16", steps=10)
    assert opt.captured
