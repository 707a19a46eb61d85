"""graphstep.Iteration on a real GPU (skipped without one): host batches copied on a side stream without racing
the replay still reading the previous batch, and the captured iteration and evaluation bitwise the eager ones."""
import pytest
import torch
import torch.nn.functional as F

import graphstep as gs
from graphstep.app import models
from graphstep.iteration import Iteration
from graphstep.iteration.inputs import StaticBatch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

DEV = torch.device("cuda", 0)


def test_the_side_stream_copy_waits_for_readers_of_the_previous_batch():
    first, second = torch.full((1 << 20,), 1.0), torch.full((1 << 20,), 2.0)  # pageable host tensors
    static = StaticBatch([first], DEV)
    assert static.side_stream is not None
    static.copy_in([first])
    torch.cuda._sleep(50_000_000)  # a replay still running on the current stream...
    seen_by_the_replay = static.tensors[0].clone()  # ...and reading the batch at its end
    static.copy_in([second])  # the next batch, copied while that runs
    after = static.tensors[0].clone()
    torch.cuda.synchronize()
    assert torch.equal(seen_by_the_replay.cpu(), first) and torch.equal(after.cpu(), second)


def _run(mode: str) -> list:
    config = models.tiny(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64)
    model = models.GPT(config, seed=0).to(DEV)
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: F.dropout(out, 0.1, module.training))
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, clip_grad=1.0, kernel="fused", capture=mode), model)
    iteration = Iteration(model, opt, lambda m, b: m(*b), capture=mode, warmup=1)
    corpus = models.SyntheticCorpus(config.vocab_size, seed=0)
    torch.manual_seed(0)
    out = []
    for step in range(12):
        inputs, targets = corpus.batch(step, 8, config.seq_len)  # on the host
        if step in (5, 6, 7):
            model.eval()
            out.append(iteration.evaluate((inputs, targets)).clone())
            model.train()
        out.append(iteration([(inputs[i::2], targets[i::2]) for i in range(2)]).loss.clone())
    assert iteration.capture_backend == ("cuda" if mode == "graph" else "eager")
    return out + [p.detach().clone() for p in model.parameters()]


def test_captured_iteration_and_evaluation_are_bitwise_eager_on_the_gpu():
    eager, graph = _run("eager"), _run("graph")
    assert all(torch.equal(a, b) for a, b in zip(eager, graph))
