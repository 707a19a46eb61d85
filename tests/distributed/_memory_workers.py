"""What the memory_stats ranks run: several configs per spawn, each built, stepped, then measured."""

from __future__ import annotations

import torch

from graphstep.config import OptimizerConfig
from graphstep import get_optimizer

# fp32/bf16 params x Adam/SGD with momentum; one captured on the replay backend (it keeps no graph pool).
CONFIGS = {
    "adam_fp32": dict(optimizer="adam"),
    "adam_bf16": dict(optimizer="adam", bf16=True),
    "sgd_fp32": dict(optimizer="sgd", sgd_momentum=0.9),
    "sgd_bf16": dict(optimizer="sgd", sgd_momentum=0.9, bf16=True),
    "adam_fp32_captured": dict(optimizer="adam", capture="graph", capture_warmup_steps=1),
}
# Several buckets per buffer (so a rank's shard is scattered over the flat buffer), padding well under 0.5%.
BUCKET = 100_000


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, 128))


def walked_bytes(opt) -> int:
    """The bytes of every distinct storage the optimizer's buffers hold, found by walking them (no
    graphstep.run.memory code): what memory_stats must agree with, scalars aside."""
    b = opt.buffers
    tensors = [*b.param_flat, *b.grad_flat, *b.main_shard, *b.grad_shard]
    tensors += [t for ts in b.state.values() for t in ts] + [t for ts in b.scratch.values() for t in ts]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def measure(rank: int, world_size: int) -> dict:
    out = {}
    for name, changes in CONFIGS.items():
        model = mlp()
        fields = dict(lr=1e-3, bucket_size=BUCKET, capture="eager", use_distributed_optimizer=True,
                      distributed_timeout_s=20.0)
        fields.update(changes)
        opt = get_optimizer(OptimizerConfig(**fields), model)
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(rank))
        for _ in range(2):  # the captured config records at its second step
            opt.zero_grad()
            model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
            opt.step()
        b = opt.buffers
        out[name] = {
            "stats": opt.memory_stats(),
            "walked": walked_bytes(opt),
            "params": sum(p.numel() for p in model.parameters()),
            "num_buckets": len(opt.layout.buckets),
            "captured": opt.captured,
            # Independent of graphstep.run.memory: the aliases ZeRO's accounting relies on.
            "main_is_param_storage": [m.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                                      for m, p in zip(b.main_shard, b.param_flat)],
            "grad_shard_in_grad_flat": all(any(g.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
                                               for f in b.grad_flat) for g in b.grad_shard),
        }
    out["accumulate_without_no_sync"] = accumulate_without_no_sync(rank)
    out["in_place_reduce_scatter_mismatches"] = in_place_reduce_scatter_mismatches(rank, world_size)
    return out


def in_place_reduce_scatter_mismatches(rank: int, world_size: int) -> list:
    """The backend's reduce-scatter with its output aliasing its input's own slice (what graphstep/step/stages/reduce.py
    runs) against a separate output, several in flight at once: the cases that differ (none expected)."""
    import torch.distributed as dist

    functional = torch.ops._c10d_functional
    name = dist.group.WORLD.group_name
    bad = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        inputs = [torch.randn(128 * world_size * k, generator=torch.Generator().manual_seed(rank * 10 + k)).to(dtype)
                  for k in (1, 3, 32)]
        separate = [torch.empty(x.numel() // world_size, dtype=dtype) for x in inputs]
        for x, out in zip(inputs, separate):
            functional.wait_tensor(functional.reduce_scatter_tensor_out(x.clone(), "sum", world_size, name, out=out))
        aliased = [x[rank * (x.numel() // world_size):(rank + 1) * (x.numel() // world_size)] for x in inputs]
        for x, out in zip(inputs, aliased):  # launched together, waited afterwards
            functional.reduce_scatter_tensor_out(x, "sum", world_size, name, out=out)
        for k, (out, expected) in enumerate(zip(aliased, separate)):
            functional.wait_tensor(out)
            if not torch.equal(out, expected):
                bad.append((str(dtype), k))
    return bad


def accumulate_without_no_sync(rank: int) -> str:
    """Two backwards into launched buckets with overlap_grad_reduce and no ``no_sync``: the in-place
    reduce-scatter cannot accumulate, so the second backward must refuse (on every rank alike)."""
    model = mlp()
    opt = get_optimizer(OptimizerConfig(lr=1e-3, bucket_size=BUCKET, capture="eager", use_distributed_optimizer=True,
                                        overlap_grad_reduce=True, distributed_timeout_s=20.0), model)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    try:
        model(x).square().mean().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"
