"""graphstep.Iteration's guards on the CPU replay backend: what changes after a capture either captures the
iteration again (and then equals the eager run bitwise), or is refused naming it."""

import pytest
import torch
import torch.nn.functional as F
from _iteration_setup import gpt_with_dropout, loss_fn, micro_batches, optimizer
from _source import line_of

import capture
from graphstep.iteration import Iteration


def twins(**config):
    """An eager and a captured iteration over identical models, and a function running both on one batch."""
    pairs = []
    for mode in ("eager", "graph"):
        model = gpt_with_dropout()
        pairs.append((model, Iteration(model, optimizer(model, **config), loss_fn, capture=mode, warmup=1)))
    state = {"step": 0}

    def both(edit=None):
        losses = []
        for model, iteration in pairs:
            if edit is not None:
                edit(model, iteration)
            torch.manual_seed(state["step"])
            losses.append(iteration(micro_batches(state["step"])).loss.clone())
        state["step"] += 1
        return losses

    return pairs, both


def assert_same(pairs):
    (eager_model, _), (graph_model, _) = pairs
    for a, b in zip(eager_model.parameters(), graph_model.parameters()):
        assert torch.equal(a, b)


def test_a_replaced_param_tensor_recaptures_and_stays_bitwise():
    pairs, both = twins()
    for _ in range(4):
        both()
    graph_iteration = pairs[1][1]
    assert graph_iteration.captured

    def replace(model, iteration):
        model.head.weight.data = model.head.weight.data * 0.5

    with pytest.warns(RuntimeWarning, match="replaced after capture: .*head.weight.*captured again"):
        both(replace)
    for _ in range(4):
        eager_loss, graph_loss = both()
        assert torch.equal(eager_loss, graph_loss)
    assert graph_iteration.recaptures == 1 and graph_iteration.captured
    assert_same(pairs)


def test_a_changed_baked_hyperparameter_recaptures():
    pairs, both = twins()  # kernel="fused": weight decay reaches the kernel as a Python float, baked in
    for _ in range(4):
        both()

    def decay(model, iteration):
        iteration.optimizer.param_groups[0]["weight_decay"] = 0.2

    with pytest.warns(RuntimeWarning, match="baked into the captured step changed .*weight_decay"):
        both(decay)
    for _ in range(3):
        both()
    assert pairs[1][1].recaptures == 1
    assert_same(pairs)


def test_a_hook_added_after_capture_recaptures_so_that_it_runs():
    pairs, both = twins()
    for _ in range(4):
        both()

    def halve_the_mlp(model, iteration):
        model.blocks[0].mlp.register_forward_hook(lambda module, args, out: out * 0.5)

    with pytest.warns(RuntimeWarning, match="hook was added or removed"):
        both(halve_the_mlp)
    for _ in range(3):
        both()
    assert pairs[1][1].recaptures == 1
    assert_same(pairs)


def test_train_and_eval_each_get_a_graph_switching_never_recaptures():
    pairs, both = twins()
    modes = ["train"] * 3 + ["eval"] * 3 + ["train", "eval", "train", "eval"]
    for mode in modes:
        both(lambda model, iteration: model.train(mode == "train"))
    graph_iteration = pairs[1][1]
    assert graph_iteration.num_graphs == 2 and graph_iteration.recaptures == 0
    assert all(entry.graph.num_replays >= 2 for entry in graph_iteration._graphs.values())
    assert_same(pairs)


@pytest.mark.parametrize("edit, refusal", [
    (lambda model: model.head.weight.requires_grad_(False), r"'head.weight' do not require grad"),
    (lambda model: setattr(model.head, "weight", torch.nn.Parameter(model.head.weight.detach().clone())),
     r"'head.weight' were replaced by new Parameter objects"),
    (lambda model: setattr(model.head.weight, "data", model.head.weight.data.double()),
     r"'head.weight' was cast to torch.float64"),
])
def test_a_frozen_replaced_or_cast_param_is_refused_naming_it(edit, refusal):
    model = gpt_with_dropout()
    iteration = Iteration(model, optimizer(model), loss_fn, capture="graph", warmup=0)
    iteration(micro_batches(0))
    edit(model)
    with pytest.raises((RuntimeError, ValueError), match=refusal):
        iteration(micro_batches(1))


def loss_with_a_host_sync(model, batch):
    loss = loss_fn(model, batch)
    if loss.item() > 100.0:  # host sync planted here
        loss = loss * 0.5
    return loss


def test_a_host_sync_in_the_loss_is_refused_naming_its_line():
    model = gpt_with_dropout()
    iteration = Iteration(model, optimizer(model), loss_with_a_host_sync, capture="graph", warmup=1)
    iteration(micro_batches(0))  # the warm-up runs eagerly: a sync is allowed there
    with pytest.raises(capture.CaptureError) as refused:
        iteration(micro_batches(1))
    line = line_of(__file__, "host sync planted here")
    assert any(f.kind == "host_sync" and f.filename.endswith("test_iteration_guards.py") and f.lineno == line
               for f in refused.value.findings), str(refused.value)


def test_python_side_effects_in_the_forward_run_at_warm_up_and_capture_only():
    model = gpt_with_dropout()
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    iteration = Iteration(model, optimizer(model), loss_fn, capture="graph", warmup=1)
    for step in range(5):
        iteration(micro_batches(step, k=2))
    assert len(calls) == 2 * 2  # warm-up and capture, 2 micro-batches each: replays run no Python


def test_a_module_buffer_replaced_after_capture_recaptures_and_reads_the_new_one():
    runs = []
    for mode in ("eager", "graph"):
        model = gpt_with_dropout()
        model.register_buffer("scale", torch.ones(()))
        iteration = Iteration(model, optimizer(model), lambda m, b: loss_fn(m, b) * m.scale, capture=mode, warmup=0)
        torch.manual_seed(0)
        losses = [iteration(micro_batches(step)).loss.clone() for step in range(2)]
        model.scale = torch.full((), 2.0)  # a new tensor: the graph read the old one's memory
        losses += [iteration(micro_batches(step)).loss.clone() for step in range(2, 4)]
        runs.append((iteration, losses))
    (_, eager_losses), (graph_iteration, graph_losses) = runs
    assert graph_iteration.recaptures == 1
    assert all(torch.equal(a, b) for a, b in zip(eager_losses, graph_losses))
