"""What the spawned ranks of test_megatron_groups.py run: _tp_workers' MLP split over two tensor-parallel ranks,
its params marked by Megatron-Core's own ``set_tensor_model_parallel_attributes`` (the replicated ones get
Megatron's defaults), built with ``get_optimizer`` and no groups, before and after Megatron-Core's
``parallel_state`` is initialised, against the same MLP whole in this process."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import graphstep as gs
from _tp_workers import H, MLP, tp_slice, train, whole_model

SPLIT = (("up.weight", 0), ("up.bias", 0), ("down.weight", 1))  # (param, partition_dim) of the split params


def _megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns that Transformer Engine and Apex are missing
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import layers
    return parallel_state, layers


def megatron_slice(rank: int, world: int, marks=SPLIT) -> MLP:
    """This rank's part of the whole MLP, marked by Megatron-Core: ``marks`` ((name, partition_dim) pairs)
    tensor-parallel, every other param with Megatron's defaults (tensor_model_parallel=False)."""
    _, layers = _megatron()
    part = tp_slice(whole_model(), rank, world)
    for p in part.parameters():  # tp_slice's own marks: Megatron asserts a param carries none yet
        for attribute in ("tensor_model_parallel", "partition_dim"):
            if hasattr(p, attribute):
                delattr(p, attribute)
    for name, dim in marks:
        layers.set_tensor_model_parallel_attributes(part.get_parameter(name), True, dim, 1)
    for p in part.parameters():
        layers.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    return part


def _refusal(build) -> str:
    try:
        build()
        return "built"
    except ValueError as error:
        return str(error)


def _param_error(part: MLP, whole: MLP, rank: int, world: int) -> float:
    rows = slice(rank * H // world, (rank + 1) * H // world)
    pairs = ((part.up.weight, whole.up.weight[rows]), (part.down.weight, whole.down.weight[:, rows]),
             (part.down.bias, whole.down.bias), (part.norm.weight, whole.norm.weight))
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)


def cases(rank: int, world: int) -> dict:
    """Every case in one set of ranks (Megatron-Core takes seconds to import): the refusals first, while
    ``parallel_state`` is not initialised, then the groups taken from it."""
    parallel_state, _ = _megatron()
    config = gs.OptimizerConfig(capture="eager")
    found = {"no_groups_no_parallel_state": _refusal(lambda: gs.get_optimizer(config, megatron_slice(rank, world)))}
    # The last rank marks ``down`` as split along its rows, or leaves ``up.bias`` unmarked.
    differing = {"partition_dim": (("up.weight", 0), ("up.bias", 0), ("down.weight", 0)),
                 "unmarked": (("up.weight", 0), ("down.weight", 1))}
    for key, marks in differing.items():
        part = megatron_slice(rank, world, marks if rank == world - 1 else SPLIT)
        found[f"marks_differ_{key}"] = _refusal(
            lambda: gs.get_optimizer(config, part, tensor_parallel_group=dist.group.WORLD))
    found["same_marks"] = _refusal(lambda: gs.get_optimizer(config, megatron_slice(rank, world),
                                                            tensor_parallel_group=dist.group.WORLD))

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    runs = {}
    for name, capture, extra in (("replicated", "eager", {}), ("captured", "graph", {}),
                                 ("distributed", "eager", {"use_distributed_optimizer": True}),
                                 ("experts", "eager", {"use_distributed_optimizer": True})):
        whole, part = whole_model(), megatron_slice(rank, world)
        if name == "experts":  # the replicated bias as an expert param: counted on expert TP rank 0 only
            part.down.bias.allreduce = False
        part.tp_group = parallel_state.get_tensor_model_parallel_group()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = train(part, capture, extra=extra)
        run["said"] = [str(w.message) for w in caught if "parallel_state" in str(w.message)]
        run["expected"] = train(whole, "eager")["norms"]
        run["worst_param_error"] = _param_error(part, whole, rank, world)
        runs[name] = run
    found["runs"] = runs
    # Some groups given, the tensor-parallel one not: not completed from parallel_state, refused by name.
    found["partly_given"] = _refusal(lambda: gs.get_optimizer(
        config, megatron_slice(rank, world), process_group=parallel_state.get_data_parallel_group()))
    return found
