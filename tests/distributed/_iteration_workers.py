"""Rank bodies for tests/distributed/test_iteration_distributed.py: graphstep.Iteration on 2 gloo ranks, captured
(CPU replay backend) against eager and against the loop a user writes with opt.step(). One spawn runs every
scenario; each returns its runs' per-iteration results (bit patterns) and final params."""

from __future__ import annotations

import warnings

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _iteration_setup import FP16, bits, gpt_with_dropout, loss_fn, micro_batches, optimizer, user_loop
from graphstep.iteration import Iteration

ITERATIONS = 8
SNAPSHOT_AT, LOAD_AT = 2, 6  # model.state_dict() taken before iteration 2, loaded back before iteration 6
EVALUATIONS = 5  # the first two eager (warm-up), the third captured: two replays
POISONED = {5: float("inf")}  # on rank 0 only: the reduced grads are non-finite on every rank, all skip


def _train(rank, wrap, run_kind, precision, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 casts the fp32 model: meant here
        bare = gpt_with_dropout()
        model = wrap(bare)
        opt = optimizer(model, capture="graph" if run_kind == "graph" else "eager", **precision, **config)
    if run_kind == "loop":
        run = user_loop(model, opt)
    else:
        iteration = Iteration(model, opt, loss_fn, capture=run_kind)
        run = lambda mbs: tuple(vars(iteration(mbs)).values())  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    torch.manual_seed(100 + rank)  # each rank its own dropout stream, the same in every run
    records, snapshot, loaded, moved = [], None, None, None
    for step in range(ITERATIONS):
        if step == SNAPSHOT_AT:
            snapshot = _copied(model.state_dict())
        if step == LOAD_AT:  # in place, as torch's load_state_dict and DCP load: the iteration must see it
            before = _copied(model.state_dict())
            model.load_state_dict(snapshot)
            loaded = all(torch.equal(bits(_local(v)), bits(_local(snapshot[k]))) for k, v in model.state_dict().items())
        poison = POISONED.get(step, 1.0) if rank == 0 else 1.0
        records.append([bits(t).clone() for t in run(micro_batches(2 * step + rank, k=2, poison=poison))])
        if step == LOAD_AT:  # one step from the loaded params, not from those it replaced (a load undone)
            moved = tuple(_distance(model.state_dict(), state) for state in (snapshot, before))
        sched.step()
    model.eval()  # then evaluations, forward only: in the iteration, captured after the first
    evaluate = iteration.evaluate if run_kind != "loop" else torch.no_grad()(lambda mb: loss_fn(model, mb))
    evaluations = [bits(evaluate(micro_batches(50 + i + rank, k=1)[0])).clone() for i in range(EVALUATIONS)]
    local = [_local(p) for p in bare.parameters()]  # FSDP2: this rank's shard
    out = {"records": records, "evaluations": evaluations, "params": [bits(p).clone() for p in local],
           "loaded": loaded, "moved": moved}
    if run_kind == "graph":
        replays = {kind: sum(e.graph.num_replays for e in iteration._graphs.values() if e.kind == kind)
                   for kind in ("train", "evaluate")}
        out.update(captured=iteration.captured, recaptures=iteration.recaptures, replays=replays["train"],
                   evaluation_replays=replays["evaluate"])
    return out


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _distance(a: dict, b: dict) -> float:
    return sum(float((_local(a[k]).double() - _local(b[k]).double()).abs().sum()) for k in a)


def _copied(state: dict) -> dict:
    """A state dict's tensors cloned (a DTensor as a DTensor over a clone of its local shard)."""
    from torch.distributed.tensor import DTensor
    return {k: DTensor.from_local(v.to_local().clone(), v.device_mesh, v.placements) if isinstance(v, DTensor)
            else v.clone() for k, v in state.items()}


def _train_tp(rank, world_size, run_kind):
    """The Megatron-split MLP of _tp_workers.py over WORLD as the tensor-parallel group (its forward all-reduces),
    2 micro-batches of the same data on both ranks; a NaN poisons rank 0's loss at one iteration."""
    import torch.distributed as dist

    import graphstep as gs
    from _tp_workers import batch, tp_slice, whole_model
    model = tp_slice(whole_model(), rank, world_size)
    config = gs.OptimizerConfig(lr=1e-2, clip_grad=0.05, weight_decay=0.01, kernel="fused", capture_warmup_steps=2,
                                capture="graph" if run_kind == "graph" else "eager")
    opt = gs.get_optimizer(config, model, tensor_parallel_group=dist.group.WORLD)
    loss = lambda m, b: m(b[0]).square().mean() * b[1]  # noqa: E731
    if run_kind == "loop":
        run = user_loop(model, opt, loss)
    else:
        iteration = Iteration(model, opt, loss, capture=run_kind)
        run = lambda mbs: tuple(vars(iteration(mbs)).values())  # noqa: E731
    records = []
    for step in range(ITERATIONS):
        x, factor = batch(step), torch.tensor(POISONED.get(step, 1.0) if rank == 0 else 1.0)
        records.append([bits(t).clone() for t in run([(x[:4], factor), (x[4:], factor)])])
    out = {"records": records, "params": [bits(p).clone() for p in model.parameters()]}
    if run_kind == "graph":
        out.update(captured=iteration.captured, recaptures=iteration.recaptures,
                   replays=sum(e.graph.num_replays for e in iteration._graphs.values()))
    return out


def fully_shard_blocks(model, **options):
    """FSDP2 over each block, then the whole model (the embeddings, final norm and head)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **{k: v for k, v in options.items() if k != "reshard_after_forward"})


def fully_shard_bf16_blocks(model):
    """FSDP2 computing in bf16 over fp32 shards, the blocks' params kept gathered from forward to backward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return fully_shard_blocks(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                              reshard_after_forward=False)


def scenarios(rank: int, world_size: int) -> dict:
    out = {}
    # DDP in fp32: with fp16/bf16 params graphstep's fp32 main grads take each grad before DDP's all-reduce.
    for name, wrap, precision, config in (
            ("ddp", DDP, {}, {}),
            ("distributed_optimizer", lambda m: m, FP16, {"use_distributed_optimizer": True}),
            ("fsdp2", fully_shard_blocks, {}, {}),
            ("fsdp2_bf16_compute", fully_shard_bf16_blocks, {}, {})):
        out[name] = {kind: _train(rank, wrap, kind, precision, **config) for kind in ("loop", "eager", "graph")}
    out["tensor_parallel"] = {kind: _train_tp(rank, world_size, kind) for kind in ("loop", "eager", "graph")}
    return out
