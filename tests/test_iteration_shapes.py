"""graphstep.Iteration with inputs whose shapes change: a graph per signature, captured on first sight, each
replayed bitwise as its eager twin; a bound on how many, refused with a message; never padded."""

import pytest
import torch
from _iteration_setup import gpt_with_dropout, loss_fn, micro_batches, optimizer

from graphstep.iteration import Iteration


def schedule(step):
    """Sequence lengths bucketed to 8 and 4, and every fifth iteration a last partial batch of 3 micro-batches."""
    mbs = micro_batches(step, seq_len=8 if step % 2 else 4)
    return mbs[:3] if step % 5 == 4 else mbs


def train(capture, iterations=30):
    model = gpt_with_dropout()
    opt = optimizer(model, capture=capture)
    iteration = Iteration(model, opt, loss_fn, capture=capture, warmup=1)
    torch.manual_seed(1)
    losses = [iteration(schedule(step)).loss.clone() for step in range(iterations)]
    return model, iteration, losses


def test_each_shape_is_captured_once_and_replays_bitwise_as_eager():
    eager_model, _, eager_losses = train("eager")
    graph_model, iteration, graph_losses = train("graph")
    assert iteration.num_graphs == 4  # (seq 4, 4 mbs), (seq 8, 4), (seq 4, 3), (seq 8, 3)
    assert iteration.recaptures == 0
    for entry in iteration._graphs.values():
        assert entry.graph.captured and entry.graph.num_replays >= 1
    assert all(torch.equal(a, b) for a, b in zip(eager_losses, graph_losses))
    assert all(torch.equal(a, b) for a, b in zip(eager_model.parameters(), graph_model.parameters()))


def test_a_new_shape_gets_its_own_static_inputs_never_padded_ones():
    model = gpt_with_dropout()
    iteration = Iteration(model, optimizer(model), loss_fn, capture="graph", warmup=0)
    iteration(micro_batches(0, seq_len=8))
    iteration(micro_batches(1, seq_len=4))
    shapes = sorted(tuple(entry.batch.tensors[0].shape) for entry in iteration._graphs.values())
    assert shapes == [(2, 4), (2, 8)]


def test_one_signature_over_the_bound_is_refused_naming_the_shapes():
    model = gpt_with_dropout()
    iteration = Iteration(model, optimizer(model), loss_fn, capture="graph", warmup=0, max_graphs=2)
    iteration(micro_batches(0, seq_len=8))
    iteration(micro_batches(1, seq_len=4))
    with pytest.raises(RuntimeError, match=r"max_graphs=2 .*int64\[2, 8\].*Bucket sequence lengths"):
        iteration(micro_batches(2, seq_len=6))
    iteration(micro_batches(3, seq_len=8))  # the shapes already captured go on replaying
