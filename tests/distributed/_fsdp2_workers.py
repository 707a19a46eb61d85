"""What the spawned ranks of test_fsdp2.py run: a small MLP sharded by FSDP2's ``fully_shard`` (uneven: its
5-row weights leave padding on the last ranks, and an empty shard on 4 ranks), stepped by graphstep, against
torch's AdamW on the same FSDP2 model and against graphstep on the unsharded model in one process."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import graphstep as gs

D_IN, HIDDEN, D_OUT, GLOBAL_BATCH = 8, 5, 6, 8
STEPS, NAN_STEP = 5, 2
TP_HIDDEN = 8  # DTensor's matmuls need an even tensor-parallel split


class Net(torch.nn.Module):
    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.up = torch.nn.Linear(D_IN, hidden)
        self.down = torch.nn.Linear(hidden, D_OUT)
        self.norm = torch.nn.LayerNorm(D_OUT)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def net(seed: int = 0, hidden: int = HIDDEN) -> Net:
    torch.manual_seed(seed)
    return Net(hidden)


def sharded(model: torch.nn.Module, mesh=None, reshard: bool = True, mp: bool = False) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp \
        else MixedPrecisionPolicy()
    for layer in (model.up, model.down, model.norm):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return model


def data(step: int):
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, D_IN, generator=generator), torch.randn(GLOBAL_BATCH, D_OUT, generator=generator)


def local_batch(step: int, rank: int, world: int):
    x, y = data(step)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def full_params(model) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def train(model, opt, steps: range, rank: int, world: int, nan_at=None) -> list:
    """Steps of graphstep's optimizer; [(applied, grad norm, num_zeros or None)] per step."""
    records = []
    for step in steps:
        x, y = local_batch(step, rank, world)
        opt.scale_loss(F.mse_loss(model(x).float(), y)).backward()  # bf16 inputs: FSDP2's policy casts them
        if step == nan_at and rank == 1:
            for p in model.parameters():  # rank 1's first non-empty shard
                if p.grad._local_tensor.numel():
                    p.grad._local_tensor.view(-1)[0] = float("nan")
                    break
        result = opt.step()
        opt.zero_grad()
        records.append((bool(result.update_successful), float(result.grad_norm),
                        None if result.num_zeros is None else int(result.num_zeros)))
    return records


def train_torch(model, opt, steps: range, rank: int, world: int) -> None:
    for step in steps:
        x, y = local_batch(step, rank, world)
        F.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()


def single_process(config: gs.OptimizerConfig, steps: range, hidden: int = HIDDEN) -> tuple[list, list]:
    """The unsharded model, the whole batch, graphstep in this process alone: (records, final params)."""
    model = net(hidden=hidden)
    opt = gs.get_optimizer(config, model, config_overrides={})
    return train(model, opt, steps, 0, 1), full_params(model)


def config(**fields) -> gs.OptimizerConfig:
    base = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.05, capture="eager")
    return gs.OptimizerConfig(**{**base, **fields})


def relative_error(found: list, expected: list) -> float:
    return max(float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(found, expected))


def run_fsdp(cfg: gs.OptimizerConfig, rank: int, world: int, steps=range(STEPS), nan_at=None, reshard=True,
             mp=False, mesh=None):
    model = sharded(net(), mesh=mesh, reshard=reshard, mp=mp)
    opt = gs.get_optimizer(cfg, model, config_overrides={})
    records = train(model, opt, steps, rank, world, nan_at=nan_at)
    return records, full_params(model), opt


def torch_parity(rank: int, world: int) -> dict:
    """graphstep's fused Adam against torch's fused AdamW on the same FSDP2 model, no clipping: bitwise."""
    out = {}
    for reshard in (True, False):
        for mp in (False, True):
            records, ours, _ = run_fsdp(config(clip_grad=0.0, kernel="fused"), rank, world, reshard=reshard, mp=mp)
            model = sharded(net(), reshard=reshard, mp=mp)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
            train_torch(model, opt, range(STEPS), rank, world)
            theirs = full_params(model)
            out[(reshard, mp)] = {"bitwise": all(torch.equal(a, b) for a, b in zip(ours, theirs)),
                                  "error": relative_error(ours, theirs), "applied": [r[0] for r in records]}
    return out


def single_process_parity(rank: int, world: int) -> dict:
    """Every family, clipped, with num_zeros: graphstep on FSDP2 against graphstep on the whole model."""
    out = {}
    for optimizer, extra in (("adam", {}), ("sgd", {"sgd_momentum": 0.9, "lr": 0.1}), ("lion", {"lr": 1e-3})):
        cfg = config(optimizer=optimizer, log_num_zeros_in_grad=True, **extra)
        records, params, _ = run_fsdp(cfg, rank, world)
        expected, expected_params = single_process(cfg, range(STEPS))
        out[optimizer] = {"records": records, "expected": expected, "error": relative_error(params, expected_params)}
    return out


def capture_and_skip(rank: int, world: int) -> dict:
    """Captured equals eager bitwise, and a NaN on rank 1 skips that step on every rank, both ways; a
    constant loss scale of 1024 changes no bit."""
    out = {}
    for capture in ("eager", "graph"):
        records, params, opt = run_fsdp(config(capture=capture, capture_warmup_steps=1), rank, world,
                                        nan_at=NAN_STEP)
        out[capture] = {"records": records, "params": params, "captured": opt.captured,
                        "recaptures": opt.recaptures}
    _, unscaled, _ = run_fsdp(config(), rank, world)
    _, scaled, _ = run_fsdp(config(loss_scale=1024.0), rank, world)
    expected_records, _ = single_process(config(), range(STEPS))
    out["scaled_bitwise"] = all(torch.equal(a, b) for a, b in zip(scaled, unscaled))
    out["expected_norms"] = [r[1] for r in expected_records]
    return out


def state_full(opt) -> dict:
    """Every state tensor as a full tensor (collective), by FQN, and the step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = opt._model_chunks[0]()
    _, osd = get_state_dict(model, opt)
    return {f"{fqn}.{name}": (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for fqn, entry in osd["state"].items() for name, v in entry.items()}


def save(rank: int, world: int, path: str, capture: str = "eager") -> dict:
    """Train, save model and optimizer with DCP, train on: what a resumed run must reproduce."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = sharded(net())
    opt = gs.get_optimizer(config(capture=capture, capture_warmup_steps=1), model, config_overrides={})
    train(model, opt, range(3), rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)
    saved = {"params": full_params(model), "state": state_full(opt)}
    train(model, opt, range(3, STEPS), rank, world)
    saved["continued"] = full_params(model)
    return saved


def load(rank: int, world: int, path: str, capture: str = "graph") -> dict:
    """A fresh model and optimizer, already captured, load the checkpoint in place and train on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = sharded(net(seed=7))
    opt = gs.get_optimizer(config(capture=capture, capture_warmup_steps=1), model, config_overrides={})
    train(model, opt, range(100, 103), rank, world)  # other data: capture, and state to overwrite
    captured = opt.captured
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    loaded = {"params": full_params(model), "state": state_full(opt)}
    train(model, opt, range(3, STEPS), rank, world)
    loaded.update(continued=full_params(model), captured_before=captured, captured=opt.captured,
                  recaptures=opt.recaptures)
    return loaded


def two_dimensional(rank: int, world: int) -> dict:
    """FSDP x TP on a 2 x 2 mesh: the MLP split column- then row-parallel over "tp", every param sharded over
    "dp" (the LayerNorm's only there: its DTensors lie on the "dp" sub-mesh), against the whole model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(net(hidden=TP_HIDDEN), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    model = sharded(model, mesh=mesh["dp"])
    cfg = config(log_num_zeros_in_grad=True)
    opt = gs.get_optimizer(cfg, model, config_overrides={})
    dp_rank = mesh.get_local_rank("dp")
    records = train(model, opt, range(STEPS), dp_rank, 2)
    expected, expected_params = single_process(cfg, range(STEPS), hidden=TP_HIDDEN)
    return {"records": records, "expected": expected, "error": relative_error(full_params(model), expected_params)}


def hybrid(rank: int, world: int) -> dict:
    """HSDP on a 2 x 2 mesh: params replicated over "replicate", sharded over "shard" (FSDP2 all-reduces the grads
    across the replicas): each element counts on replica 0 only, against the whole model."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    cfg = config(log_num_zeros_in_grad=True)
    records, params, _ = run_fsdp(cfg, rank, world, mesh=mesh)
    expected, expected_params = single_process(cfg, range(STEPS))
    return {"records": records, "expected": expected, "error": relative_error(params, expected_params)}


def cases(rank: int, world: int, load_from, save_to) -> dict:
    """Every case of this world size on one set of ranks; checkpoints loaded from and saved to directories."""
    warnings.filterwarnings("ignore", message=".*without DistributedDataParallel")  # the one-process oracle
    report = {}
    if load_from is not None:
        report["loaded"] = load(rank, world, load_from)
    if world > 1:
        report["torch"] = torch_parity(rank, world)
        report["single"] = single_process_parity(rank, world)
        report["capture"] = capture_and_skip(rank, world)
    if world == 4:
        report["2d"] = two_dimensional(rank, world)
        report["hsdp"] = hybrid(rank, world)
    if save_to is not None:
        report["saved"] = save(rank, world, save_to)
        report["reloaded"] = load(rank, world, save_to)  # the same world size: a bitwise resume
    return report


def checkpoint_path(root: str, world: int) -> str:
    return os.path.join(root, f"saved_on_{world}")
