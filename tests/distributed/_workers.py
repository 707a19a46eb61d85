"""What the spawned ranks run (module-level, so "spawn" can import them by name)."""

from __future__ import annotations

import math
import os
import signal
import time

import torch
from _harness import local_loss, tiny_transformer

from graphstep.config import OptimizerConfig
from graphstep import get_optimizer
from graphstep.parallel.collectives import CollectiveError

# The settings the parity runs share: clipping on and active (the toy's grad norm is ~1-3), several buckets
# per buffer (so ranks own pieces of some groups and nothing of others), one injected non-finite step.
STEPS = 20
INF_STEP = 7
CLIP = 0.5
BUCKET = 3000

CONFIGS = {
    "sgd_fp32": dict(optimizer="sgd", lr=0.05, weight_decay=1e-3, sgd_momentum=0.9),
    "adam_fp32": dict(optimizer="adam", lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95),
    "adam_bf16": dict(optimizer="adam", lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, bf16=True),
    # fp16 grads are reduced with a 1/dp pre-scale and a SUM (the other path of graphstep/step/stages/reduce.py).
    "sgd_fp16_grads": dict(optimizer="sgd", lr=0.05, weight_decay=1e-3, sgd_momentum=0.9, fp16=True,
                           main_grads_dtype=torch.float16, loss_scale=128.0),
}


def make_config(name: str, world_size: int, **changes) -> OptimizerConfig:
    fields = dict(CONFIGS[name], clip_grad=CLIP, bucket_size=BUCKET, capture="eager",
                  use_distributed_optimizer=world_size > 1, distributed_timeout_s=20.0)
    fields.update(changes)
    return OptimizerConfig(**fields)


def train(config: OptimizerConfig, rank: int, world_size: int, *, steps: int = STEPS, inf_step=INF_STEP,
          inf_rank=None, micro_batches: int = 1, model=None) -> dict:
    """Train the toy for ``steps``; rank ``inf_rank`` (default: the last) makes step ``inf_step``'s grads
    non-finite. Returns final params, per-step flags and norms, and the optimizer state's size."""
    model = tiny_transformer() if model is None else model
    start = [p.detach().clone().float() for p in model.parameters()]
    opt = get_optimizer(config, model)
    inf_rank = world_size - 1 if inf_rank is None else inf_rank
    ok, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(micro_batches):
            loss = local_loss(model, step * micro_batches + micro, rank, world_size) / micro_batches
            if step == inf_step and rank == inf_rank and micro == 0:
                loss = loss * math.inf
            if micro < micro_batches - 1:
                with opt.no_sync():  # earlier micro-batches only accumulate
                    opt.scale_loss(loss).backward()
            else:
                opt.scale_loss(loss).backward()
        result = opt.step()
        ok.append(bool(result.update_successful.item()))
        norms.append(float(result.grad_norm.item()))
    opt.finish_param_gather()
    owned_groups = sorted({s.group for s in opt.layout.segments(opt.rank)})
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "start": start,
        "ok": ok,
        "norms": norms,
        "state_numel": sum(t.numel() for tensors in opt.buffers.state.values() for t in tensors),
        "main_numel": sum(opt.buffers.main_shard_values(b).numel() for b in range(len(opt.buffers.main_shard))),
        "param_numel": sum(p.numel() for p in model.parameters()),
        "owned_groups": owned_groups,
        "num_groups": opt.layout.num_groups,
        "num_buckets": len(opt.layout.buckets),
        "overlap": (opt.overlap_counts["launched_reduces"], opt.overlap_counts["waited_gathers"]),
    }


def parity(rank: int, world_size: int, names: tuple) -> dict:
    return {name: train(make_config(name, world_size), rank, world_size) for name in names}


def first_backward(rank: int, world_size: int, before_the_build: bool, steps: int = 3) -> dict:
    """Adam for ``steps``; the first backward runs before ``get_optimizer`` or after it (its grads must be
    reduced and applied by the first step either way)."""
    model = tiny_transformer()
    start = [p.detach().clone().float() for p in model.parameters()]
    if before_the_build:
        local_loss(model, 0, rank, world_size).backward()
    opt = get_optimizer(make_config("adam_fp32", world_size), model)
    for step in range(steps):
        if step or not before_the_build:
            opt.zero_grad()
            local_loss(model, step, rank, world_size).backward()
        opt.step()
    opt.finish_param_gather()
    return {"params": [p.detach().clone() for p in model.parameters()], "start": start}


def weights_loaded_after_the_build(rank: int, world_size: int, how: str = "load_state_dict",
                                   checkpoint_dir: str = "") -> dict:
    """bf16 Adam; weights of another seed loaded into the model after ``get_optimizer``, then one step at lr 0
    (it moves nothing, and publishes each rank's main params to every rank): the params must be the loaded
    ones, so every rank's main params took the loaded values of the ranges it owns. ``how``: through
    ``model.load_state_dict``, or ``torch.distributed.checkpoint.load`` into ``model.state_dict()`` (which writes
    in place into the state dict's values: their version counters are not the params')."""
    import torch.distributed.checkpoint as dcp

    loaded = tiny_transformer(seed=1).to(torch.bfloat16).state_dict()
    if how == "dcp":
        dcp.save(loaded, checkpoint_id=checkpoint_dir)
    model = tiny_transformer()
    opt = get_optimizer(make_config("adam_bf16", world_size), model)
    local_loss(model, 0, rank, world_size).backward()
    opt.step()  # moments and main params of the first weights
    if how == "dcp":
        dcp.load(model.state_dict(), checkpoint_id=checkpoint_dir)
    else:
        model.load_state_dict(loaded)
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.zero_grad()
    local_loss(model, 1, rank, world_size).backward()
    opt.step()
    opt.finish_param_gather()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "loaded": loaded}


def capture_vs_eager(rank: int, world_size: int) -> dict:
    out = {}
    for mode in ("eager", "graph"):
        config = make_config("adam_fp32", world_size, capture=mode, capture_warmup_steps=2)
        model = tiny_transformer()
        opt = get_optimizer(config, model)
        ok = []
        for step in range(10):
            opt.zero_grad()
            loss = local_loss(model, step, rank, world_size)
            if step == 6 and rank == 0:
                loss = loss * math.inf
            loss.backward()
            ok.append(bool(opt.step().update_successful.item()))
        out[mode] = {"params": [p.detach().clone() for p in model.parameters()], "ok": ok,
                     "captured": bool(opt.captured)}
    return out


def one_rank_replaces_a_param(rank: int, world_size: int) -> dict:
    """Capture, then only rank 1 replaces a param's tensor (same values) at step 5: every rank must
    recapture at that step, and the run must equal an eager one bitwise."""
    out = {}
    for mode in ("eager", "graph"):
        config = make_config("adam_fp32", world_size, capture=mode, capture_warmup_steps=1)
        model = tiny_transformer()
        opt = get_optimizer(config, model)
        recaptured_at = []
        for step in range(8):
            opt.zero_grad()
            local_loss(model, step, rank, world_size).backward()
            if step == 5 and rank == 1:
                weight = model[3].weight
                weight.data = weight.detach().clone()  # a new tensor: the capture's addresses are stale
            before = opt.recaptures
            opt.step()
            if opt.recaptures != before:
                recaptured_at.append(step)
        out[mode] = {"params": [p.detach().clone() for p in model.parameters()], "recaptured_at": recaptured_at,
                     "captured": bool(opt.captured)}
    return out


def overlap(rank: int, world_size: int) -> dict:
    out = {}
    for name, changes, micro in (("plain", {}, 1),
                                 ("overlap", dict(overlap_grad_reduce=True, overlap_param_gather=True), 1),
                                 ("plain_accum", {}, 2),
                                 ("overlap_accum", dict(overlap_grad_reduce=True, overlap_param_gather=True), 2)):
        out[name] = train(make_config("adam_fp32", world_size, **changes), rank, world_size, steps=8, inf_step=3,
                          micro_batches=micro)
    return out


def dropped_optimizer(rank: int, world_size: int) -> dict:
    """An optimizer with overlap hooks (and the fold's), trained, then dropped: are its buffers freed and its
    hooks gone from the model, and does the model still run a forward and backward without it?"""
    import gc
    import weakref

    model = tiny_transformer()
    opt = get_optimizer(make_config("adam_fp32", world_size, overlap_grad_reduce=True, overlap_param_gather=True),
                        model)
    for step in range(2):
        opt.zero_grad()
        local_loss(model, step, rank, world_size).backward()
        opt.step()
    opt.finish_param_gather()
    launched = opt.overlap_counts["launched_reduces"]
    buffers = weakref.ref(opt.buffers)
    del opt
    gc.collect()
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    hooks += sum(len(m._forward_pre_hooks) for m in model.modules())
    local_loss(model, 2, rank, world_size).backward()  # no hook left to launch a collective
    return {"launched": launched, "freed": buffers() is None, "hooks_left": hooks}


def mismatch(rank: int, world_size: int) -> dict:
    errors = {}
    width = 32 if rank == 0 else 48
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Linear(width, 4))
    try:
        get_optimizer(make_config("sgd_fp32", world_size), model)
        errors["model"] = None
    except ValueError as exc:
        errors["model"] = str(exc)
    lr = 0.05 if rank == 0 else 0.1
    try:
        get_optimizer(make_config("sgd_fp32", world_size, lr=lr), tiny_transformer())
        errors["config"] = None
    except ValueError as exc:
        errors["config"] = str(exc)
    errors["object_exchanges"] = object_exchange_groups(world_size)
    return errors


def object_exchange_groups(world_size: int) -> list[dict]:
    """For every object collective a successful build runs: its group's backend, and whether it is the
    group the step's collectives run on (NCCL on GPUs, whose object collectives use the current device)."""
    import torch.distributed as dist

    seen = []
    real = dist.all_gather_object

    def recording(output, obj, group=None):
        seen.append(group)
        return real(output, obj, group=group)

    dist.all_gather_object = recording
    try:
        opt = get_optimizer(make_config("adam_fp32", world_size, capture="graph"), tiny_transformer())
    finally:
        dist.all_gather_object = real
    return [{"backend": str(dist.get_backend(group)), "step_group": group is opt.comm.dp_group} for group in seen]


def failing_peer(rank: int, world_size: int, how: str, timeout_s: float, capture: str = "eager") -> dict:
    """Rank ``world_size - 1`` dies (SIGKILL) or stops answering (sleeps) after step 3's backward."""
    config = make_config("adam_fp32", world_size, distributed_timeout_s=timeout_s, capture=capture,
                         capture_warmup_steps=1)
    model = tiny_transformer()
    opt = get_optimizer(config, model)
    for step in range(20):
        opt.zero_grad()
        local_loss(model, step, rank, world_size).backward()
        if step == 3 and rank == world_size - 1:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        started = time.monotonic()
        try:
            opt.step()
        except CollectiveError as exc:
            return {"step": step, "elapsed": time.monotonic() - started, "error": str(exc), "what": exc.what,
                    "captured": bool(opt.captured)}
    return {"step": None}


def compiled_kernel(rank: int, world_size: int) -> dict:
    """The Adam parity run with kernel="compiled": its loops over this rank's shard views."""
    return train(make_config("adam_fp32", world_size, kernel="compiled"), rank, world_size)


def auto_kernel_agreement(rank: int, world_size: int) -> dict:
    """kernel="auto" built twice: with every rank's probe passing, then with rank 1's failing (the probe
    results are set, not run: nothing compiles here). Returns each build's choice and warnings. The native
    loop is off: with it, an fp32 Adam step on the CPU has nothing for torch.compile to do, and is not probed."""
    import warnings

    from graphstep.kernels import auto
    from graphstep.native import update_loops

    auto.COMPILE_MIN_NUMEL = 0  # the tiny model stands for a large one (as tests/conftest.py sets)
    out = {}
    for case, failing_rank in (("all_work", None), ("rank1_fails", 1)):
        works = rank != failing_rank
        auto._probed[("cpu", -1, torch.float64)] = (works, "" if works else "forced failure", 0.0)
        with warnings.catch_warnings(record=True) as caught, update_loops.off():
            warnings.simplefilter("always")
            opt = get_optimizer(make_config("adam_fp32", world_size, kernel="auto"), tiny_transformer())
        out[case] = {"name": opt.kernel_choice.name, "reason": opt.kernel_choice.reason,
                     "warnings": [str(w.message) for w in caught if "kernel='auto'" in str(w.message)]}
    return out


def compiled_kernel_refused_on_every_rank(rank: int, world_size: int) -> dict:
    """kernel="compiled" with rank 1's probe failing (set, not run): what each rank's build raised, or None.
    The native loop is off, as in ``auto_kernel_agreement``."""
    from graphstep.kernels import auto
    from graphstep.native import update_loops

    works = rank != 1
    auto._probed[("cpu", -1, torch.float64)] = (works, "" if works else "forced failure", 0.0)
    try:
        with update_loops.off():
            get_optimizer(make_config("adam_fp32", world_size, kernel="compiled"), tiny_transformer())
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": None}


def teardown_after_capture(rank: int, world_size: int) -> dict:
    """Capture a 2-rank step, then tear the job down the way perf/train_ddp.py's users might: without
    closing the optimizer first."""
    import torch.distributed as dist

    model = tiny_transformer()
    opt = get_optimizer(make_config("adam_fp32", world_size, capture="graph", capture_warmup_steps=1), model)
    for step in range(3):
        opt.zero_grad()
        local_loss(model, step, rank, world_size).backward()
        opt.step()
    captured_before = opt.captured
    dist.destroy_process_group()
    return {"captured_before": captured_before, "captured_after": opt.captured}
