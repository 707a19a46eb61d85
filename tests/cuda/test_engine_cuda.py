"""The engine on a GPU: CUDA-graph replay against eager, bitwise, for every precision and kernel (skipped
without an NVIDIA GPU).

Bitwise means everything a step owns or reports: the model params, every leaf of ``opt.state_dict()``
(step count, fp32 main params, each state tensor, the loss scaler) and, step by step, the StepResult's
found_inf (``update_successful``), grad norm and loss scale; and the captured run never recaptured.
"""

import pytest
import torch

from _bitwise import assert_state_equal
from _training import train

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")]

INF_STEP = 17


def run(mode, precision, steps=40, kernel="fused"):
    """``steps`` steps under a schedule with one inf grad; returns the model, the optimizer and each step's
    (update_successful, grad_norm, loss_scale)."""
    return train(mode, precision, steps=steps, inf_step=INF_STEP, kernel=kernel)


def assert_bitwise_equal(eager, graph):
    (model_e, opt_e, reported_e), (model_g, opt_g, reported_g) = eager, graph
    for i, (a, b) in enumerate(zip(model_e.parameters(), model_g.parameters())):
        assert torch.equal(a, b), f"param {i}"
    assert_state_equal(opt_e, opt_g)
    for step, (a, b) in enumerate(zip(reported_e, reported_g)):
        for name, x, y in zip(("found_inf", "grad_norm", "loss_scale"), a, b):
            assert torch.equal(x, y), f"{name} at step {step}"
    assert not reported_g[INF_STEP][0].item(), "the inf step must be skipped"


@pytest.mark.parametrize("kernel", ["fused", "compiled"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_graph_replay_is_bitwise_equal_to_eager(precision, kernel):
    # kernel="compiled": the Triton loop is compiled in the eager warm-up, then launched inside the graph.
    eager = run("eager", precision, kernel=kernel)
    graph = run("graph", precision, kernel=kernel)
    opt = graph[1]
    assert opt.captured and opt.capture_backend == "cuda"
    assert opt.recaptures == 0
    assert_bitwise_equal(eager, graph)


def test_auto_captures_on_cuda():
    _, opt, _ = run("auto", "bf16", steps=10)
    assert opt.captured and opt.recaptures == 0
