"""graphstep.Iteration on the CPU replay backend: the captured iteration (forward, backward of every
micro-batch, the optimizer step) against the same code run eagerly, and the eager one against the loop a user
writes with opt.step(). Bitwise, with dropout, fp16 dynamic loss scaling, clipping and an lr schedule."""

import warnings

import pytest
import torch
from _iteration_setup import FP16, bits, gpt_with_dropout, loss_fn, micro_batches, optimizer, user_loop

from graphstep.iteration import Iteration

POISONED = {7: float("inf"), 19: float("nan"), 30: float("inf")}  # iteration -> loss factor: grads inf/NaN


def build(**config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16=True casts the fp32 model: warned, and meant here
        model = gpt_with_dropout()
        return model, optimizer(model, **FP16, **config)


def train(run_iteration, opt, iterations=50):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    torch.manual_seed(1)  # dropout's draws: the same stream for every run
    records = []
    for step in range(iterations):
        result = run_iteration(micro_batches(step, poison=POISONED.get(step, 1.0)))
        if not isinstance(result, tuple):
            result = (result.loss, result.grad_norm, result.update_successful, result.loss_scale, result.skipped_steps)
        records.append([bits(t).clone() for t in result])
        sched.step()
    return records


def test_captured_iteration_is_bitwise_the_eager_one_and_the_users_loop_over_50_iterations():
    loop_model, loop_opt = build()
    loop = train(user_loop(loop_model, loop_opt), loop_opt)
    eager_model, eager_opt = build()
    eager_iteration = Iteration(eager_model, eager_opt, loss_fn, capture="eager")
    eager = train(eager_iteration, eager_opt)
    graph_model, graph_opt = build()
    graph_iteration = Iteration(graph_model, graph_opt, loss_fn, capture="graph")
    graph = train(graph_iteration, graph_opt)

    assert eager_iteration.capture_backend == "eager" and not eager_iteration.captured
    assert graph_iteration.capture_backend == "replay" and graph_iteration.captured
    (entry,) = graph_iteration._graphs.values()
    assert entry.graph.num_replays == 50 - 2 - 1 and graph_iteration.recaptures == 0  # warm-up 2, capture 1
    flags = [bool(r[2]) for r in graph]
    assert not any(flags[s] for s in POISONED) and sum(flags) >= 40  # skipped on device where poisoned
    scales = [r[3].view(torch.float32).item() for r in graph]
    assert any(b < a for a, b in zip(scales, scales[1:])) and max(scales) > scales[0]  # backed off, and grew
    for name, run in (("eager iteration", eager), ("user's loop", loop)):
        for step, (a, b) in enumerate(zip(graph, run)):
            for field, x, y in zip(("loss", "grad_norm", "update", "scale", "skipped"), a, b):
                assert torch.equal(x, y), f"iteration {step}: {field} differs from the {name}"
    for a, b, c in zip(graph_model.parameters(), eager_model.parameters(), loop_model.parameters()):
        assert torch.equal(bits(a), bits(b)) and torch.equal(bits(a), bits(c))
    for name in graph_opt.buffers.state:
        for a, b in zip(graph_opt.buffers.state[name], eager_opt.buffers.state[name]):
            assert torch.equal(bits(a), bits(b))


def test_replays_draw_new_dropout_numbers():
    model, opt = build(lr=0.0, weight_decay=0.0)  # params never move: only dropout can change the loss
    iteration = Iteration(model, opt, loss_fn, capture="graph", warmup=0)
    mbs = micro_batches(0)
    losses = [iteration(mbs).loss.clone() for _ in range(4)]
    assert iteration.captured
    assert len({float(x) for x in losses}) == 4  # each replay drew its own masks


def test_result_is_static_and_read_without_sync():
    model, opt = build()
    iteration = Iteration(model, opt, loss_fn, capture="graph", warmup=0)
    first = iteration(micro_batches(0))
    second = iteration(micro_batches(1))
    assert first is second and second.loss.data_ptr() == iteration.result.loss.data_ptr()
    assert second.grad_norm is opt.result.grad_norm


@pytest.mark.parametrize("wrong", [{}, {"batch": 1, "micro_batches": [1]}, {"micro_batches": []}])
def test_a_call_takes_micro_batches_or_one_batch(wrong):
    model, opt = build()
    iteration = Iteration(model, opt, loss_fn, capture="eager")
    with pytest.raises(TypeError, match="micro.batches"):
        iteration(**wrong)


def test_a_loss_that_is_not_one_element_is_refused():
    model, opt = build()
    iteration = Iteration(model, opt, lambda m, b: m(b[0]), capture="eager")
    with pytest.raises(TypeError, match=r"one-element tensor .* returned a tensor of shape"):
        iteration(batch=micro_batches(0)[0])


def test_auto_runs_eagerly_off_cuda():
    model, opt = build()
    iteration = Iteration(model, opt, loss_fn, capture="auto")
    iteration(micro_batches(0))
    iteration(micro_batches(1))
    assert iteration.capture_backend == "eager" and not iteration.captured


def test_cpu_offload_is_refused_at_construction():
    model = gpt_with_dropout()
    opt = optimizer(model, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    with pytest.raises(ValueError, match="CPU offload .* runs host work after the device step"):
        Iteration(model, opt, loss_fn, capture="graph")
