"""graphstep.Iteration.evaluate on the CPU replay backend: the forward-only graph for evaluation, captured per
signature like training, bitwise its eager twin and a plain no_grad forward, and leaving the training graph as it
was (training after evaluation still bitwise the eager run)."""

import pytest
import torch
from _iteration_setup import bits, gpt_with_dropout, loss_fn, micro_batches, optimizer

from graphstep.iteration import Iteration


def twins(**kwargs):
    """An eager and a captured iteration over identical models."""
    pairs = []
    for mode in ("eager", "graph"):
        model = gpt_with_dropout()
        pairs.append((model, Iteration(model, optimizer(model), loss_fn, capture=mode, warmup=1, **kwargs)))
    return pairs


def eval_batch(step, seq_len=8):
    return micro_batches(100 + step, k=1, batch_size=4, seq_len=seq_len)[0]


def test_evaluation_is_captured_bitwise_as_eager_and_training_after_it_stays_bitwise():
    runs = []
    for model, iteration in twins():
        torch.manual_seed(0)
        train_losses, eval_losses, direct = [], [], []
        for round_ in range(3):
            for step in range(3):
                train_losses.append(iteration(micro_batches(3 * round_ + step)).loss.clone())
            model.eval()
            for step in range(3):  # two shapes: each its own evaluation graph
                batch = eval_batch(step, seq_len=8 if step % 2 else 4)
                eval_losses.append(iteration.evaluate(batch).clone())
                with torch.no_grad():
                    direct.append(loss_fn(model, batch))  # the oracle: a plain forward
            model.train()
        runs.append((model, iteration, train_losses, eval_losses, direct))
    (eager_model, _, eager_train, eager_eval, _), (graph_model, iteration, graph_train, graph_eval, direct) = runs
    for name, a, b in (("training loss", eager_train, graph_train), ("evaluation", eager_eval, graph_eval),
                       ("evaluation vs a plain forward", direct, graph_eval)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(bits(x), bits(y)), f"{name} {i}: {x} != {y}"
    for a, b in zip(eager_model.parameters(), graph_model.parameters()):
        assert torch.equal(bits(a), bits(b))
    assert iteration.recaptures == 0
    evaluations = [e for key, e in iteration._graphs.items() if e.kind == "evaluate"]
    trainings = [e for key, e in iteration._graphs.items() if e.kind == "train"]
    assert len(evaluations) == 2 and all(e.graph.captured and e.graph.num_replays >= 1 for e in evaluations)
    (training,) = trainings
    assert training.graph.num_replays == 9 - 1 - 1  # warm-up, capture, then replays only: evaluation recaptured none


def test_evaluation_in_train_mode_draws_dropout_like_eager():
    losses = []
    for model, iteration in twins():
        torch.manual_seed(3)
        losses.append([iteration.evaluate(eval_batch(step)).clone() for step in range(4)])
    eager, graph = losses
    assert all(torch.equal(a, b) for a, b in zip(eager, graph))
    with torch.no_grad():
        plain = loss_fn(gpt_with_dropout().eval(), eval_batch(0))
    assert not torch.equal(plain, graph[0])  # dropout was on: the evaluation ran the model as it was (train mode)


def test_eval_fn_returns_a_nest_of_static_tensors():
    def metrics(model, batch):
        inputs, targets, _ = batch
        logits = model(inputs)
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()),
                "correct": (logits.argmax(-1) == targets).sum()}

    model = gpt_with_dropout().eval()
    iteration = Iteration(model, optimizer(model), loss_fn, eval_fn=metrics, capture="graph", warmup=0)
    results = [iteration.evaluate(eval_batch(step)) for step in range(3)]
    assert results[0] is results[2] and set(results[2]) == {"loss", "correct"}
    with torch.no_grad():
        expected = metrics(model, eval_batch(2))
    assert torch.equal(results[2]["loss"], expected["loss"]) and torch.equal(results[2]["correct"], expected["correct"])
    assert iteration.captured  # the third call replayed (the first evaluation of a signature always runs eagerly)


def test_a_param_replaced_before_an_evaluation_is_taken_back_and_read():
    outputs = []
    for model, iteration in twins():
        torch.manual_seed(0)
        for step in range(3):
            iteration(micro_batches(step))
        model.eval()
        evaluations = [iteration.evaluate(eval_batch(0)).clone() for _ in range(2)]
        model.head.weight.data = model.head.weight.data * 0.5
        with pytest.warns(RuntimeWarning, match="replaced after capture") if iteration.captured else _no_warning():
            evaluations.append(iteration.evaluate(eval_batch(0)).clone())
        with torch.no_grad():
            evaluations.append(loss_fn(model, eval_batch(0)))
        evaluations.append(iteration.evaluate(eval_batch(0)).clone())
        outputs.append(evaluations)
    eager, graph = outputs
    assert all(torch.equal(a, b) for a, b in zip(eager, graph))
    assert torch.equal(graph[2], graph[3]) and not torch.equal(graph[1], graph[2])  # read the halved weight


def test_eval_fn_must_return_tensors():
    model = gpt_with_dropout()
    iteration = Iteration(model, optimizer(model), loss_fn, eval_fn=lambda m, b: 1.0, capture="eager")
    with pytest.raises(TypeError, match="eval_fn must return a tensor or a nest of tensors"):
        iteration.evaluate(eval_batch(0))


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
