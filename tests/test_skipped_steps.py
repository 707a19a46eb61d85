"""``StepResult.skipped_steps``: the run's count of skipped steps, on the device, so a loop learns how many steps
were skipped by reading one tensor where it already syncs instead of every step's ``update_successful``."""

import pytest
import torch

from tests._engine import make_engine


def _run(capture: str, skip_at: set, threshold: float = float("inf")):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = make_engine(model, lr=1e-2, capture=capture, grad_norm_skip_threshold=threshold)
    flags = []
    for step in range(8):
        model(torch.randn(3, 16)).square().sum().backward()
        if step in skip_at:
            model.weight.grad[0, 0] = float("inf") if threshold == float("inf") else 1e6
        result = opt.step()
        flags.append(bool(result.update_successful))
        opt.zero_grad()
    return result, flags, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("capture", ["eager", "graph"])
def test_skipped_steps_counts_the_steps_with_non_finite_grads(capture):
    result, flags, _ = _run(capture, skip_at={1, 4, 5})
    assert result.skipped_steps.dtype == torch.int64 and result.skipped_steps.dim() == 0
    assert flags.count(False) == 3
    assert int(result.skipped_steps) == 3


def test_skipped_steps_counts_steps_over_the_skip_threshold_and_replay_equals_eager():
    eager, _, eager_params = _run("eager", skip_at={2, 6}, threshold=1e3)
    graph, _, graph_params = _run("graph", skip_at={2, 6}, threshold=1e3)
    assert int(eager.skipped_steps) == int(graph.skipped_steps) == 2
    for a, b in zip(eager_params, graph_params):
        assert torch.equal(a, b)
