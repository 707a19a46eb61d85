"""The distributed optimizer with hybrid CPU offload on 2 gloo ranks: each rank offloads part of its own
shard, and the run is bitwise equal to the same run without offload (on this CPU-only machine both sides
run the same fused kernel), for fractions 0.3, 0.5 and 1.0, eager and captured, with clipping, a loss
scale (fp16), an lr schedule and a non-finite step on one rank. One spawn runs them all."""

import pytest
import torch

import _offload_workers as workers
from _harness import spawn, values

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results():
    return values(spawn(workers.offload_parity, 2, timeout=90))


@pytest.mark.parametrize("run", workers.RUNS, ids=lambda r: f"{r[0]}-{r[2]}-{'-'.join(r[1]) or 'fp32'}")
@pytest.mark.parametrize("fraction", workers.FRACTIONS[1:])
def test_offloaded_shards_match_the_run_without_offload_bitwise(results, run, fraction):
    rule, precision, mode = run
    for rank, result in enumerate(results):
        ref = result[(rule, str(precision), mode, None)]
        got = result[(rule, str(precision), mode, fraction)]
        assert got["ok"] == ref["ok"] and not ref["ok"][workers.INF_STEP], f"rank {rank}: skips differ"
        assert got["captured"] == ref["captured"] == (mode == "graph")
        for a, b in zip(got["params"], ref["params"]):
            assert torch.equal(a, b), f"rank {rank}: params differ at fraction {fraction}"
        for a, b in zip(got["main"], ref["main"]):
            assert torch.equal(a.cpu(), b.cpu()), f"rank {rank}: main params differ"
        for name in ref["state"]:
            for a, b in zip(got["state"][name], ref["state"][name]):
                assert torch.equal(a.cpu(), b.cpu()), f"rank {rank}: {name} differs"
        assert got["sharded"].keys() == ref["sharded"].keys()
        for key, value in ref["sharded"].items():
            if value is None:
                assert got["sharded"][key] is None
            else:
                assert torch.equal(got["sharded"][key].cpu(), value.cpu()), f"rank {rank}: {key} differs"
        # Each rank really updated part of its own shard on the host, and the device kept less.
        assert got["host_numel"] > 0
        assert got["device_main_numel"] + got["host_numel"] >= ref["device_main_numel"]
        assert got["device_state_numel"] < ref["device_state_numel"]
        if fraction == 1.0:
            assert got["device_main_numel"] == got["device_state_numel"] == 0
        # Half grads are cast to fp32 for the device update only, never for the part the host updates.
        cast = "main_grads_dtype" in precision
        assert got["grad_cast_numel"] == (got["device_part_numel"] if cast else 0)
        assert ref["grad_cast_numel"] == (ref["device_part_numel"] if cast else 0)


def test_overlap_with_several_ranks_is_refused_with_what_to_do():
    for message in values(spawn(workers.overlap_refused, 2, timeout=30)):
        assert "overlap_cpu_optimizer_d2h_h2d" in message and "turn the overlap off" in message
