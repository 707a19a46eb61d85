"""Replay of c10d collectives: 2 gloo ranks, captured step bitwise equal to eager."""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

import capture
from _harness import spawn, values

WORLD = 2
STEPS = 10
N = 8


def _make_state(rank):
    gen = torch.Generator().manual_seed(100 + rank)
    return {
        "param": torch.randn(N, generator=gen),
        "grad": torch.zeros(N),
        "shard": torch.zeros(N // WORLD),
        "gathered": torch.zeros(N),
        "stat": torch.zeros(2),
        "fsum": torch.zeros(N),
        "pieces": torch.zeros(WORLD, N // WORLD),
    }


def _make_step(st):
    def step():
        dist.all_reduce(st["grad"])  # sum over ranks, in place
        st["grad"].div_(WORLD)
        dist.reduce_scatter_tensor(st["shard"], st["grad"])  # gloo finishes it in wait()
        st["shard"].mul_(0.1)
        dist.all_gather_into_tensor(st["gathered"], st["shard"])
        st["param"].sub_(st["gathered"])
        st["stat"][0].copy_(st["param"].square().sum())
        st["stat"][1].copy_(st["shard"].abs().max())
        work = dist.all_reduce(st["stat"], op=dist.ReduceOp.MAX, async_op=True)
        work.wait()
        # List form: c10d.allgather_ takes Tensor[][] outputs (nested list arguments).
        dist.all_gather(list(st["pieces"].unbind(0)), st["shard"] * 2)
        # Functional collectives dispatch as _c10d_functional.* ops and replay too.
        st["fsum"].add_(fc.all_reduce(st["param"], "sum", dist.group.WORLD) * 0.5)
        return st["param"].sum() * 1.0  # a fresh output

    return step


def _feed(st, rank, i):
    gen = torch.Generator().manual_seed(1000 * i + rank)
    st["grad"].copy_(torch.randn(N, generator=gen))


def _history(call, st, rank):
    rows = []
    for i in range(STEPS):
        _feed(st, rank, i)
        out = call()
        rows.append((out.clone(), {k: v.clone() for k, v in st.items()}))
    return rows


def _worker(rank, _world_size):  # spawn's signature; the step divides by WORLD
    warnings.simplefilter("ignore")
    st_e = _make_state(rank)
    eager = _history(_make_step(st_e), st_e, rank)
    st_c = _make_state(rank)
    g = capture.graph(_make_step(st_c), warmup=1, backend="replay")
    replayed = _history(g, st_c, rank)
    mismatches = []
    # What the recorder saw: the c10d ops themselves, not gloo's internals.
    recorded = {str(ins.func) for ins in g._backend._program.instrs}
    for op in ("c10d.allreduce_.default", "c10d._reduce_scatter_base_.default", "c10d._allgather_base_.default",
               "_c10d_functional.all_reduce.default", "c10d.allgather_.default"):
        if op not in recorded:
            mismatches.append(f"{op} not recorded (saw {sorted(recorded)})")
    for i, ((out_e, s_e), (out_c, s_c)) in enumerate(zip(eager, replayed)):
        if not torch.equal(out_e, out_c):
            mismatches.append(f"output at step {i}")
        mismatches += [f"{k} at step {i}" for k in s_e if not torch.equal(s_e[k], s_c[k])]
    # The parent compares the ranks' params and stats with each other.
    return mismatches, g.num_replays, st_c["param"].tolist(), st_c["stat"].tolist()


@pytest.mark.distributed
def test_captured_collectives_replay_bitwise_equal_to_eager():
    # values() raises the traceback of a rank that failed; a rank that wrote nothing fails spawn itself.
    results = dict(enumerate(values(spawn(_worker, WORLD, timeout=90))))
    for rank, (mismatches, replays, _, _) in results.items():
        assert mismatches == [], f"rank {rank}: captured differs from eager: {mismatches}"
        assert replays == STEPS - 2
    # All-gathered updates keep the ranks' params moving by the same amounts.
    p0, p1 = torch.tensor(results[0][2]), torch.tensor(results[1][2])
    d0 = p0 - _make_state(0)["param"]
    d1 = p1 - _make_state(1)["param"]
    assert torch.equal(d0, d1) or torch.allclose(d0, d1, rtol=0, atol=1e-6)
    assert d0.abs().sum() > 0
    assert results[0][3] == results[1][3]  # MAX all-reduce agrees across ranks
