"""The optimizer's hooks on the model (the folded norm's, the fp32 main grads', the overlapped CPU offload's
forward waits) against the model outliving it: a dropped optimizer frees its buffers and leaves no hook
behind, and an optimizer built over a model that already has one trains exactly as if it were the only one.
(The overlap hooks of several ranks: tests/distributed/test_capture_overlap.py.)"""

import gc
import weakref

import pytest
import torch

import graphstep as gs
from toy import loss_fn, tiny_transformer

PRECISIONS = {"fp32": {}, "bf16": {"bf16": True}}


def config(precision: str, **changes) -> gs.OptimizerConfig:
    return gs.OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.1, clip_grad=0.5, capture="eager",
                              **PRECISIONS[precision], **changes)


def hooks_on(model: torch.nn.Module) -> int:
    return (sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
            + sum(len(m._forward_pre_hooks) for m in model.modules()))


def train(model, opt, steps: int = 3) -> list:
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.step()
    opt.finish_param_gather()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("changes", [{}, dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                                              overlap_cpu_optimizer_d2h_h2d=True)], ids=["plain", "offload"])
def test_a_dropped_optimizer_frees_its_buffers_and_leaves_no_hook(precision, changes):
    model = tiny_transformer()
    opt = gs.get_optimizer(config(precision, **changes), model)
    assert hooks_on(model) > 0
    train(model, opt)
    buffers = weakref.ref(opt.buffers)
    del opt
    gc.collect()
    assert buffers() is None
    assert hooks_on(model) == 0
    loss_fn(model, 9).backward()  # the model still trains without it: a plain .grad, in the param's dtype
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in model.parameters())


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_a_second_optimizer_over_the_same_model_trains_as_the_only_one(precision):
    # The first one stays alive: its hooks find the params taken by the second and leave them alone (a bf16
    # model used to fail its first backward here: two main-grad hooks, the second finding no grad).
    model = tiny_transformer()
    first = gs.get_optimizer(config(precision), model)
    second = gs.get_optimizer(config(precision), model)
    alone = tiny_transformer()
    if precision == "bf16":  # the second optimizer seeds its fp32 main params from the first's bf16 params
        alone.to(torch.bfloat16)
    expected = train(alone, gs.get_optimizer(config(precision), alone))
    assert all(torch.equal(a, b) for a, b in zip(train(model, second), expected))
    assert first.fold_counts == {"in_backward": 0, "before_step": 0}


def test_deepcopy_is_refused_with_the_way_that_works():
    # A deep copy used to come back broken (AttributeError at its first step): refused at the copy instead.
    import copy

    model = torch.nn.Linear(4, 4)
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-2, capture="eager"), model)
    with pytest.raises(TypeError, match="cannot be deep-copied.*load this one's state_dict"):
        copy.deepcopy(opt)
    model(torch.randn(2, 4)).sum().backward()
    assert bool(opt.step().update_successful)  # the original is untouched
