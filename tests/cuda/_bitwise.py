"""Bitwise comparison of two optimizers' whole state, for the CUDA tests (eager versus captured)."""

import torch


def leaves(value, path=""):
    """(path, leaf) pairs of a nested state dict: every tensor and plain value it holds."""
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in leaves(item, f"{path}.{key}")]
    if isinstance(value, (list, tuple)):
        return [leaf for i, item in enumerate(value) for leaf in leaves(item, f"{path}[{i}]")]
    return [(path, value)]


def assert_state_equal(opt_a, opt_b):
    """Every leaf of ``state_dict()`` equal: step count, fp32 main params, each state tensor, the loss scaler."""
    state_a, state_b = leaves(opt_a.state_dict()), leaves(opt_b.state_dict())
    assert [path for path, _ in state_a] == [path for path, _ in state_b]
    for (path, a), (_, b) in zip(state_a, state_b):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, path
