"""What the spawned ranks of test_tensor_parallel_experts.py run: tensor parallelism (TP = 2) times data
parallelism (DP = 2) on 4 ranks, with MoE expert params next to the split dense MLP of _tp_workers.py,
against the whole model in one process.

Ranks: TP groups {0, 1} and {2, 3}, data-parallel groups {0, 2} and {1, 3}. Two experts, each a small MLP
(up, activation, down with a bias) marked ``allreduce=False``; every token goes through both (no router: the
norm's bookkeeping is what is tested, not routing). Two expert layouts, both Megatron-Core's:

- expert TP = 2 (the expert TP group is the TP group): every rank holds both experts, split like the dense
  MLP (``up`` by rows, ``down`` by columns); each expert's ``down`` bias is replicated over the expert TP
  group, so it counts on expert-TP rank 0 only.
- expert TP = 1, expert parallelism = 2 over the TP ranks: TP rank t holds expert t whole, its output summed
  over the TP group as a token all-to-all would combine it. Each rank's experts differ from its TP peer's,
  so every expert param counts on every rank: reading the dense TP rank, as Megatron-Core does, would leave
  expert 1's bias out of the norm.

The expert data-parallel group is the data-parallel group in both: the ranks holding the same experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import graphstep as gs
from _tp_workers import D, LONG_STEPS, MLP, NAN_STEP, _SumOverTensorParallel, batch, whole_model, tp_slice

EXPERT_H, EXPERTS = 8, 2


def _expert(hidden: int) -> torch.nn.Module:
    expert = torch.nn.Module()
    expert.up, expert.down = torch.nn.Linear(D, hidden), torch.nn.Linear(hidden, D)
    for p in expert.parameters():
        p.allreduce = False  # Megatron-Core's mark of an expert param
    return expert


class MoEMLP(torch.nn.Module):
    """The dense MLP of _tp_workers.py plus ``len(experts)`` experts of ``expert_hidden`` rows each; with
    ``expert_tp``, each expert is a TP slice (its output partial, summed over the TP group before the bias);
    with ``expert_parallel``, the experts' outputs are summed over the TP group (one expert per TP rank)."""

    def __init__(self, dense: MLP, experts: int, expert_hidden: int, expert_tp: bool = False,
                 expert_parallel: bool = False):
        super().__init__()
        self.dense = dense
        self.experts = torch.nn.ModuleList(_expert(expert_hidden) for _ in range(experts))
        self.expert_tp, self.expert_parallel = expert_tp, expert_parallel

    def forward(self, x):
        total = 0.0
        for expert in self.experts:
            partial = torch.nn.functional.linear(torch.nn.functional.gelu(expert.up(x)), expert.down.weight)
            if self.expert_tp:
                partial = _SumOverTensorParallel.apply(partial, self.dense.tp_group)
            total = total + partial + expert.down.bias
        if self.expert_parallel:
            total = _SumOverTensorParallel.apply(total, self.dense.tp_group)
        return self.dense(x) + total


def whole_moe() -> MoEMLP:
    model = MoEMLP(whole_model(), EXPERTS, EXPERT_H)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.experts.parameters():
            p.uniform_(-0.4, 0.4)
    return model


def part_of(whole: MoEMLP, tp_rank: int, tp_group, expert_tp: int) -> tuple[MoEMLP, list]:
    """This rank's model cut from ``whole``, and [(its param, a function giving the matching piece of a whole
    model)] to compare them after training."""
    dense = tp_slice(whole.dense, tp_rank, 2)
    dense.tp_group = tp_group
    rows = slice(tp_rank * EXPERT_H // 2, (tp_rank + 1) * EXPERT_H // 2)
    if expert_tp == 2:  # both experts, each split like the dense MLP; the down bias replicated
        part = MoEMLP(dense, EXPERTS, EXPERT_H // 2, expert_tp=True)
        cuts = {"up.weight": ((rows,), 0), "up.bias": ((rows,), 0), "down.weight": ((slice(None), rows), 1),
                "down.bias": ((), None)}
        held = list(range(EXPERTS))
    else:  # expert tp_rank whole
        part = MoEMLP(dense, 1, EXPERT_H, expert_parallel=True)
        cuts = {name: ((), None) for name in ("up.weight", "up.bias", "down.weight", "down.bias")}
        held = [tp_rank]
    pairs = []
    for mine, index in zip(part.experts, held):
        for name, (cut, dim) in cuts.items():
            p = mine.get_parameter(name)
            piece = (lambda model, index=index, name=name, cut=cut:
                     model.experts[index].get_parameter(name)[cut])
            with torch.no_grad():
                p.copy_(piece(whole))
            if dim is not None:
                p.tensor_model_parallel, p.partition_dim = True, dim
            pairs.append((p, piece))
    dense_rows = slice(tp_rank * dense.up.weight.shape[0], (tp_rank + 1) * dense.up.weight.shape[0])
    pairs += [(dense.up.weight, lambda model: model.dense.up.weight[dense_rows]),
              (dense.down.weight, lambda model: model.dense.down.weight[:, dense_rows]),
              (dense.down.bias, lambda model: model.dense.down.bias),
              (dense.norm.weight, lambda model: model.dense.norm.weight)]
    return part, pairs


def _nan_into_first_expert_bias(model: MoEMLP) -> None:
    model.experts[0].down.bias.grad[0] = float("nan")


def cases(rank: int, world: int, which: tuple) -> dict:
    """Every case of ``which`` ((expert TP size, optimizer) pairs) in one set of ranks: {case: report}."""
    return {case: tensor_parallel_with_experts(rank, world, *case) for case in which}


def tensor_parallel_with_experts(rank: int, world: int, expert_tp: int, optimizer: str) -> dict:
    """Eager and captured runs of LONG_STEPS steps against the whole model in this process (over both data-
    parallel ranks' batches). At NAN_STEP rank 3 alone writes a NaN into its first expert's ``down`` bias grad
    (with expert TP = 2 a replicated param that rank does not count): every rank must skip that step, as the
    reference does with the NaN in its own grad."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    singletons = [dist.new_group([r]) for r in range(world)]
    tp_rank, dp_rank = rank % 2, rank // 2
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    expert_tp_group = tp_group if expert_tp == 2 else singletons[rank]
    config = dict(lr=1e-2, clip_grad=0.05, weight_decay=0.0, capture_warmup_steps=1, log_num_zeros_in_grad=True,
                  kernel="fused", optimizer=optimizer, muon_fp32_matmul_prec="highest",
                  muon_tp_mode="duplicated")

    def loss(model, step, dp):
        # Not _tp_workers' batches: with those, one expert grad element of step 19 sums two data-parallel halves
        # that cancel to 3e-9 in one process and to exactly 0 split, a legitimate difference in num_zeros.
        return model(batch(1000 + 10 * step + dp)).square().mean()

    whole = whole_moe()
    reference = gs.get_optimizer(gs.OptimizerConfig(capture="eager", **config), whole)
    expected = []
    for step in range(LONG_STEPS):
        reference.zero_grad()
        (sum(loss(whole, step, dp) for dp in range(2)) / 2).backward()
        if step == NAN_STEP:
            _nan_into_first_expert_bias(whole)
        result = reference.step()
        expected.append((bool(result.update_successful), float(result.grad_norm), int(result.num_zeros)))
    runs, worst, trained = {}, {}, {}
    for capture in ("eager", "graph"):
        part, pairs = part_of(whole_moe(), tp_rank, tp_group, expert_tp)
        opt = gs.get_optimizer(gs.OptimizerConfig(capture=capture, use_distributed_optimizer=True, **config), part,
                               process_group=dp_group, tensor_parallel_group=tp_group,
                               expert_data_parallel_group=dp_group, expert_tensor_parallel_group=expert_tp_group)
        found = []
        for step in range(LONG_STEPS):
            opt.zero_grad()
            loss(part, step, dp_rank).backward()
            if step == NAN_STEP and rank == 3:
                _nan_into_first_expert_bias(part)
            result = opt.step()
            found.append((bool(result.update_successful), float(result.grad_norm), int(result.num_zeros)))
        runs[capture] = {"found": found, "captured": opt.captured}
        worst[capture] = max(float((p.detach() - piece(whole).detach()).abs().max() / piece(whole).detach().abs().max()) for p, piece in pairs)
        trained[capture] = [p.detach().clone() for p in part.parameters()]
    bitwise = all(torch.equal(a, b) for a, b in zip(trained["eager"], trained["graph"]))
    # Megatron-Core's reading: an expert param's copies by the dense TP rank. With expert TP = 1, TP rank 1's
    # expert bias is then counted nowhere.
    part, _ = part_of(whole_moe(), tp_rank, tp_group, expert_tp)
    dense_reading = gs.get_optimizer(gs.OptimizerConfig(capture="eager", use_distributed_optimizer=True, **config),
                                     part, process_group=dp_group, tensor_parallel_group=tp_group,
                                     expert_data_parallel_group=dp_group, expert_tensor_parallel_group=tp_group)
    loss(part, 0, dp_rank).backward()
    first_norm_by_dense_tp_rank = float(dense_reading.step().grad_norm)
    return {"expected": expected, "runs": runs, "worst_param_error": worst, "captured_equals_eager": bitwise,
            "first_norm_by_dense_tp_rank": first_norm_by_dense_tp_rank}
