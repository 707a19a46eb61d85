"""The one post-accumulate-grad hook per param per optimizer (graphstep/hooks/param_hooks.py): its listeners run in
the declared order, are held weakly, go with their owner (close(), collection), and leave a param a later
optimizer took alone. (Several ranks, where the overlap listens: tests/distributed/test_capture_overlap.py
and test_folded_norm_sharded.py.)"""

import gc
import weakref

import pytest
import torch

import graphstep as gs
from graphstep.step.stages.norm import ROW

CONFIGS = {
    "fp32": dict(fold_grad_norm=False),
    "fp32_fold": dict(fold_grad_norm=True),
    "bf16_fold": dict(bf16=True, fold_grad_norm=True),  # bf16 params, fp32 main grads through the hook
    "bf16": dict(bf16=True, fold_grad_norm=False),
}


def mlp(name: str = "fp32") -> torch.nn.Module:
    """A model with a param of several 4,096-element rows (folded in backward on one rank) and small ones."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.Tanh(), torch.nn.Linear(512, 4))
    assert model[0].weight.numel() >= 2 * ROW
    return model.to(torch.bfloat16 if CONFIGS[name].get("bf16") else torch.float32)


def loss_fn(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    inputs, targets = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    return (model(inputs.to(model[0].weight.dtype)).float() - targets).square().mean()


def config(**changes) -> gs.OptimizerConfig:
    return gs.OptimizerConfig(**{**dict(optimizer="adam", lr=3e-3, weight_decay=0.1, clip_grad=0.5,
                                        capture="eager"), **changes})


def hook_counts(model: torch.nn.Module) -> list[int]:
    return [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]


def train(model, opt, steps: int = 3, first_step: int = 0) -> list:
    for step in range(first_step, first_step + steps):
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.small_fold_units
def test_every_param_has_one_hook_from_the_optimizer(name):
    model = mlp(name)
    opt = gs.get_optimizer(config(**CONFIGS[name]), model)
    assert hook_counts(model) == [1] * len(hook_counts(model))  # before any backward: the grads-seen flag too
    train(model, opt, steps=2)
    # After a backward the grads-seen listener is gone: a hook stays where a main grad or the fold listens
    # (the fold: on the params of the units folded in backward, not on those only in a buffer's tail).
    hooks = opt.build_record.grad_hooks
    folded = [CONFIGS[name]["fold_grad_norm"] and "fold" in hooks.stages_of(p) for p in model.parameters()]
    assert any(folded) == CONFIGS[name]["fold_grad_norm"]
    stays = [CONFIGS[name].get("bf16", False) or fold for fold in folded]
    assert hook_counts(model) == [int(s) for s in stays]


def test_the_listeners_run_in_the_declared_order_whatever_order_they_were_added_in():
    from graphstep.hooks.param_hooks import STAGES, GradHooks

    class Owner:
        def __init__(self, calls):
            self.calls = calls

        def arrived(self, stage, param):
            self.calls.append((stage, param))

    model = torch.nn.Linear(3, 2)
    opt = gs.get_optimizer(config(), model)  # the params' buffers (and ownership) of a real optimizer
    opt.close()
    hooks, calls = GradHooks(), []
    owners = [Owner(calls) for _ in STAGES]
    for stage, owner in reversed(list(zip(STAGES, owners))):
        hooks.listen(stage.name, opt.buffers, 0, owner, "arrived", stage.name)
    model(torch.ones(1, 3)).sum().backward()
    param = opt.buffers.params[0]
    assert calls == [(stage.name, param) for stage in STAGES]
    assert hooks.stages_of(param) == tuple(stage.name for stage in STAGES)
    assert [s.name for s in STAGES] == ["main_grad", "grads_seen", "fold", "overlap"]
    with pytest.raises(ValueError, match="param_hooks.STAGES"):
        hooks.listen("offload", opt.buffers, 1, owners[0], "arrived", "offload")


@pytest.mark.small_fold_units
def test_an_engine_listens_in_the_declared_order():
    model = mlp("bf16_fold")
    opt = gs.get_optimizer(config(**CONFIGS["bf16_fold"]), model)
    stages = [opt.build_record.grad_hooks.stages_of(p) for p in model.parameters()]
    assert all(s in (("main_grad", "grads_seen", "fold"), ("main_grad", "grads_seen")) for s in stages)
    assert ("main_grad", "grads_seen", "fold") in stages
    # The fold reads the grad main_grad just accumulated: the folded norm is the unfolded one's.
    other = mlp("bf16")
    unfolded = gs.get_optimizer(config(**CONFIGS["bf16"]), other)
    for opt_, model_ in ((opt, model), (unfolded, other)):
        opt_.zero_grad()
        loss_fn(model_, 0).backward()
    folded_norm, plain_norm = opt.step().grad_norm, unfolded.step().grad_norm
    assert opt.fold_counts["in_backward"] > 0 and opt.fold_counts["before_step"] == 0
    torch.testing.assert_close(folded_norm, plain_norm, rtol=1e-6, atol=0.0)


def test_a_listener_whose_owner_died_does_nothing():
    from graphstep.hooks.param_hooks import GradHooks

    class Owner:
        calls = 0

        def arrived(self, param):
            Owner.calls += 1

    model = torch.nn.Linear(3, 2)
    opt = gs.get_optimizer(config(), model)
    opt.close()
    hooks, owner = GradHooks(), Owner()
    hooks.listen("fold", opt.buffers, 0, owner, "arrived")
    model(torch.ones(1, 3)).sum().backward()
    del owner
    gc.collect()
    model(torch.ones(1, 3)).sum().backward()
    assert Owner.calls == 1
    del hooks  # the dispatcher's collection removes its hook
    gc.collect()
    assert hook_counts(model) == [0, 0]


@pytest.mark.parametrize("trained", [False, True], ids=["before_backward", "trained"])
@pytest.mark.parametrize("name", ["fp32", "bf16_fold"])
def test_a_dropped_optimizer_is_collected_and_leaves_no_hook(name, trained):
    model = mlp(name)
    opt = gs.get_optimizer(config(**CONFIGS[name]), model)
    if trained:
        train(model, opt, steps=1)
    refs = [weakref.ref(o) for o in (opt, opt.buffers, opt.build_record.grads_seen, opt.build_record.fold)]
    del opt
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    assert hook_counts(model) == [0] * len(hook_counts(model))
    loss_fn(model, 5).backward()  # nothing of it runs: plain grads in the params' dtype
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in model.parameters())


@pytest.mark.parametrize("name", ["fp32_fold", "bf16_fold"])
@pytest.mark.small_fold_units
def test_a_second_optimizer_takes_the_params_over(name):
    model = mlp(name)
    first = gs.get_optimizer(config(**CONFIGS[name]), model)
    second = gs.get_optimizer(config(**CONFIGS[name]), model)
    assert hook_counts(model) == [2] * len(hook_counts(model))  # one per optimizer
    train(model, second, steps=2)
    assert first.fold_counts == {"in_backward": 0, "before_step": 0}
    assert all(not g.any() for g in first.buffers.grad_flat)  # its main grads never got a backward
    assert second.fold_counts["in_backward"] > 0


@pytest.mark.filterwarnings("ignore:graphstep. step.. ran before any backward")  # close() dropped that flag too
@pytest.mark.small_fold_units
def test_close_keeps_only_the_main_grads_hook_and_trains_as_before():
    # close() drops the fold's and the grads-seen listeners; the fp32 main grads still accumulate through the
    # one remaining hook, and a step folds the norm itself: bitwise the optimizer that was not closed.
    runs = []
    for close in (False, True):
        model = mlp("bf16_fold")
        opt = gs.get_optimizer(config(**CONFIGS["bf16_fold"]), model)
        if close:
            opt.close()
            assert all(opt.build_record.grad_hooks.stages_of(p) == ("main_grad",) for p in model.parameters())
            assert hook_counts(model) == [1] * len(hook_counts(model))
        runs.append(train(model, opt))
        assert opt.fold_counts["before_step" if close else "in_backward"] > 0
    assert all(torch.equal(a, b) for a, b in zip(*runs))
