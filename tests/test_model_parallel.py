"""graphstep/plan/model_parallel.py: which params count in the grad norm, from Megatron-Core's marks."""

import pytest
import torch

import graphstep as gs
from graphstep.plan.model_parallel import NormCounting, check_marks

V, D = 12, 8


class TiedLM(torch.nn.Module):
    """An embedding whose weight is also the output projection: one param (``untie=False``), or two
    copies the way pipeline stages hold them, the second marked ``shared`` (``untie=True``)."""

    def __init__(self, untie: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, D)
        self.mix = torch.nn.Linear(D, D)
        self.output = torch.nn.Parameter(self.embed.weight.detach().clone()) if untie else None
        if untie:
            self.output.shared = True

    def forward(self, tokens):
        out = self.output if self.output is not None else self.embed.weight
        return torch.nn.functional.linear(torch.tanh(self.mix(self.embed(tokens))), out)


def test_the_second_copy_of_a_shared_embedding_counts_in_no_norm():
    # Megatron-Core all-reduces the two copies' grads between the first and last pipeline stage, so both hold
    # the whole grad of the tied weight; the norm must count it once, as the one tied param's.
    tokens = torch.randint(0, V, (4, 6), generator=torch.Generator().manual_seed(1))
    runs = {}
    for untie in (False, True):
        model = TiedLM(untie)
        opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-2, clip_grad=0.1, capture="eager", log_num_zeros_in_grad=True),
                               model)
        model(tokens).square().mean().backward()
        if untie:  # what Megatron's embedding-group all-reduce leaves in both copies
            total = model.embed.weight.grad + model.output.grad
            model.embed.weight.grad.copy_(total)
            model.output.grad.copy_(total)
        result = opt.step()
        runs[untie] = (float(result.grad_norm), int(result.num_zeros))
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-6)
    assert runs[True][1] == runs[False][1]


def test_the_marks_are_read_as_megatron_core_reads_them():
    split, replicated, shared = (torch.nn.Parameter(torch.zeros(4, 2)) for _ in range(3))
    split.tensor_model_parallel, split.partition_dim = True, 1
    shared.shared = True
    assert [NormCounting(tp_rank=0).counts(p) for p in (split, replicated, shared)] == [True, True, False]
    assert [NormCounting(tp_rank=1).counts(p) for p in (split, replicated, shared)] == [True, False, False]
    # an expert param's copies are counted by its rank in the expert tensor-parallel group, not the dense one
    replicated.allreduce = False
    assert NormCounting(tp_rank=1, expert_tp_rank=0).counts(replicated)
    assert not NormCounting(tp_rank=0, expert_tp_rank=1).counts(replicated)
    check_marks("split", split)
    split.partition_dim = 2
    with pytest.raises(ValueError, match="partition_dim=2, not a dimension of its shape"):
        check_marks("split", split)
