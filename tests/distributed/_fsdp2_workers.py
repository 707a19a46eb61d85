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
EVEN_HIDDEN = 8  # DTensor's tensor-parallel matmuls and Muon need matrices split evenly


class Net(torch.nn.Module):
    def __init__(self, hidden: int = HIDDEN, out: int = D_OUT):
        super().__init__()
        self.up = torch.nn.Linear(D_IN, hidden)
        self.down = torch.nn.Linear(hidden, out)
        self.norm = torch.nn.LayerNorm(out)
        self.out = out

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def net(seed: int = 0, hidden: int = HIDDEN) -> Net:
    """The 5-row (uneven) model; with ``hidden=EVEN_HIDDEN`` every matrix is 8 x 8 (even on 2 and 4 ranks)."""
    torch.manual_seed(seed)
    return Net(hidden, D_OUT if hidden == HIDDEN else hidden)


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
    return torch.randn(GLOBAL_BATCH, D_IN, generator=generator), torch.randn(GLOBAL_BATCH, 8, generator=generator)


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
        # Under a bf16 MixedPrecisionPolicy FSDP2 casts the inputs itself.
        opt.scale_loss(F.mse_loss(model(x).float(), y[:, :model.out])).backward()
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
        F.mse_loss(model(x).float(), y[:, :model.out]).backward()
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


def relative_drift(found: list, expected: list, start: list) -> float:
    """‖found − expected‖ / ‖expected − start‖: drift relative to the params' motion (docs/design.md §8)."""
    num = sum(float(((a.double() - b.double()) ** 2).sum()) for a, b in zip(found, expected))
    return (num / sum(float(((b.double() - s.double()) ** 2).sum()) for b, s in zip(expected, start))) ** 0.5


def relative_error(found: list, expected: list) -> float:
    return max(float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(found, expected))


def run_fsdp(cfg: gs.OptimizerConfig, rank: int, world: int, steps=range(STEPS), nan_at=None, reshard=True,
             mp=False, mesh=None, hidden=HIDDEN):
    model = sharded(net(hidden=hidden), mesh=mesh, reshard=reshard, mp=mp)
    opt = gs.get_optimizer(cfg, model, config_overrides={})
    records = train(model, opt, steps, rank, world, nan_at=nan_at)
    return records, full_params(model), opt


class Aligned(torch.nn.Module):
    """Two 5 x 16 weights (uneven row shards, every shard a multiple of 16 elements): torch's fused AdamW then
    runs each shard in whole vector lanes, as graphstep's run over its 64-aligned flat buffer does, so both
    round every element alike (a tensor's tail past the last full lane takes torch's scalar path)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Parameter(torch.randn(HIDDEN, 16) / 4)
        self.down = torch.nn.Parameter(torch.randn(HIDDEN, 16) / 4)
        self.out = 8

    def forward(self, x):
        return (torch.relu(torch.cat([x, x], dim=1) @ self.up.T) @ self.down)[:, :8]


def _torch_pair(model_fn, rank: int, world: int, reshard: bool, mp: bool) -> tuple[list, list, list, list]:
    """(graphstep's records, its final params, torch's final params, the initial params) on one FSDP2 model kind."""
    start = full_params(model_fn())
    ours_model = sharded_root(model_fn(), reshard=reshard, mp=mp)
    opt = gs.get_optimizer(config(clip_grad=0.0, kernel="fused"), ours_model, config_overrides={})
    records = train(ours_model, opt, range(STEPS), rank, world)
    theirs_model = sharded_root(model_fn(), reshard=reshard, mp=mp)
    reference = torch.optim.AdamW(theirs_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    train_torch(theirs_model, reference, range(STEPS), rank, world)
    return records, full_params(ours_model), full_params(theirs_model), start


def sharded_root(model: torch.nn.Module, reshard: bool = True, mp: bool = False) -> torch.nn.Module:
    return sharded(model, reshard=reshard, mp=mp) if isinstance(model, Net) else _fully_shard_root(model, reshard, mp)


def _fully_shard_root(model: torch.nn.Module, reshard: bool, mp: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp \
        else MixedPrecisionPolicy()
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    return model


def torch_parity(rank: int, world: int) -> dict:
    """graphstep's fused Adam against torch's fused AdamW on the same FSDP2 model, no clipping: bitwise where
    both kernels round alike (``Aligned``), within drift relative to the motion on the model with biases."""
    out = {}
    for reshard in (True, False):
        for mp in (False, True):
            records, ours, theirs, _ = _torch_pair(Aligned, rank, world, reshard, mp)
            _, ours_net, theirs_net, start = _torch_pair(net, rank, world, reshard, mp)
            out[(reshard, mp)] = {"bitwise": all(torch.equal(a, b) for a, b in zip(ours, theirs)),
                                  "error": relative_error(ours, theirs), "applied": [r[0] for r in records],
                                  "drift": relative_drift(ours_net, theirs_net, start)}
    return out


# Muon on the whole model in one process is the oracle of both ways FSDP2's row shards are orthogonalised whole
# (fp32 matmuls: in bf16 the distributed Newton-Schulz's other association of the same products differs by bf16's
# rounding).
_MUON = {"muon_fp32_matmul_prec": "highest"}
FAMILY_CASES = {"adam": {}, "sgd": {"sgd_momentum": 0.9, "lr": 0.1}, "lion": {"lr": 1e-3}, "ademamix": {},
                "muon-duplicated": {"muon_tp_mode": "duplicated", **_MUON},
                "muon-distributed": {"muon_tp_mode": "distributed", **_MUON},
                "adam-bf16-moments": {"use_precision_aware_optimizer": True, "exp_avg_dtype": torch.bfloat16,
                                      "exp_avg_sq_dtype": torch.bfloat16}}


def single_process_parity(rank: int, world: int) -> dict:
    """Every family, clipped, with num_zeros: graphstep on FSDP2 against graphstep on the whole model."""
    out = {}
    for case, extra in FAMILY_CASES.items():
        optimizer = case.split("-")[0]
        hidden = EVEN_HIDDEN if optimizer == "muon" else HIDDEN
        cfg = config(optimizer=optimizer, log_num_zeros_in_grad=True, **extra)
        records, params, _ = run_fsdp(cfg, rank, world, hidden=hidden)
        expected, expected_params = single_process(cfg, range(STEPS), hidden=hidden)
        out[case] = {"records": records, "expected": expected, "error": relative_error(params, expected_params)}
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
    model = opt.build_record.model_chunks[0]()
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
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    model = parallelize_module(net(hidden=EVEN_HIDDEN), mesh["tp"], plan)
    model = sharded(model, mesh=mesh["dp"])
    cfg = config(log_num_zeros_in_grad=True)
    opt = gs.get_optimizer(cfg, model, config_overrides={})
    dp_rank = mesh.get_local_rank("dp")
    records = train(model, opt, range(STEPS), dp_rank, 2)
    expected, expected_params = single_process(cfg, range(STEPS), hidden=EVEN_HIDDEN)
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


def full_state_dict_round_trip(rank: int, world: int) -> dict:
    """torch's full (unsharded) state dict of a trained model and optimizer, set into a fresh pair: equal?"""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    full = StateDictOptions(full_state_dict=True)
    model = sharded(net())
    opt = gs.get_optimizer(config(), model, config_overrides={})
    train(model, opt, range(3), rank, world)
    msd, osd = get_state_dict(model, opt, options=full)
    fresh = sharded(net(seed=7))
    fresh_opt = gs.get_optimizer(config(), fresh, config_overrides={})
    train(fresh, fresh_opt, range(100, 102), rank, world)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd, options=full)
    expected, found = state_full(opt), state_full(fresh_opt)
    return {"full_tensors": all(not hasattr(v, "_local_tensor") for e in osd["state"].values() for v in e.values()),
            "state_equal": expected.keys() == found.keys() and all(torch.equal(found[k], expected[k])
                                                                   for k in expected),
            "params_equal": all(torch.equal(a, b) for a, b in zip(full_params(fresh), full_params(model)))}


def muon_refusals(rank: int, world: int) -> dict:
    """What Muon cannot do on FSDP2 shards, as the messages the builds raised (None: built)."""
    from torch.distributed.device_mesh import init_device_mesh

    def message(model) -> str:
        try:
            gs.get_optimizer(config(optimizer="muon", muon_tp_mode="duplicated"), model, config_overrides={})
        except ValueError as error:
            return str(error)
        return None

    out = {"uneven": message(sharded(net()))}
    if world == 4:
        out["two_dimensional"] = message(sharded(net(hidden=EVEN_HIDDEN), mesh=init_device_mesh(
            "cpu", (2, 2), mesh_dim_names=("replicate", "shard"))))
    return out


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
        report["muon_refusals"] = muon_refusals(rank, world)
        report["full_state_dict"] = full_state_dict_round_trip(rank, world)
    if world == 4:
        report["2d"] = two_dimensional(rank, world)
        report["hsdp"] = hybrid(rank, world)
    if save_to is not None:
        report["saved"] = save(rank, world, save_to)
        report["reloaded"] = load(rank, world, save_to)  # the same world size: a bitwise resume
    return report


def checkpoint_path(root: str, world: int) -> str:
    return os.path.join(root, f"saved_on_{world}")
