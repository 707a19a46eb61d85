"""perf/gpu_check.py's ``--peers`` part: graphstep's default step against the peers that compile instead of
capture, on the device, in one interleaved run.

The rows are perf/bench_peers.py's (the same builders, timer and ratios, perf/peer_pipelines.py), at GPT-2
small on a GPU and at a two-layer GPT-2 shape in the CPU dry run. Their compiles take minutes on a GPU, so
the part runs in its own invocation (``perf/gpu_check.sh OUT --peers``), outside the one-GPU budget. Each
goal is stated with its bytes: a clipped peer reads the grads for the norm as graphstep does (32 B/param),
so graphstep must be ahead of it; an unclipped one moves 28 B/param, so graphstep's clipped step may trail
it by the norm's read, at most by ``PEER_SLACK`` of the byte ratio. A peer that cannot run here (heavyball
not installed) is skipped saying why. Build and first step, where the compiles fall, are reported apart.
"""

from __future__ import annotations

import bench_peers
import peer_pipelines as peers
from capture.devices import is_cuda
from graphstep.app import bench_core as core
from graphstep.app import bench_shapes
from gpu_check_numerics import NO_CUDA, record

CLIPPED_BYTES = core.GRAPHSTEP_BYTES  # the norm's read of the grads, then Adam's (a clip that also writes the
# grads back moves more)
UNCLIPPED_BYTES = core.ADAM_BYTES
PEER_SLACK = 0.9  # the byte ratio a bandwidth-bound device shows, less this much for what bytes do not count
PEER_ROWS = ("torch-compiled-clip", "torch-compiled", "heavyball-clip", "heavyball")
ROWS = ("graphstep", *PEER_ROWS, "floor")
ROW_START_LIMIT_S = 100  # a row not built and through its first step by then is given up, so the others still run
CHECKS = tuple(f"peers-default-vs-{peer}" for peer in PEER_ROWS)


def _goal(peer: str) -> tuple[float, int]:
    """The least speedup of graphstep over ``peer`` that its bytes allow, and the peer's bytes per param."""
    peer_bytes = CLIPPED_BYTES if peers.CLIPPED[peer] else UNCLIPPED_BYTES
    return (1.0 if peers.CLIPPED[peer] else PEER_SLACK * peer_bytes / CLIPPED_BYTES), peer_bytes


def part_peers(device, small: bool) -> list[dict]:
    shapes = bench_shapes.gpt2(n_layer=2, d_model=128, vocab=1024, n_ctx=128) if small else bench_shapes.gpt2_small()
    inputs = core.Inputs(shapes, device)
    warmup, rounds = (1, 3) if small else (3, 30)
    results = {r["row"]: r for r in bench_peers.run_shape(list(ROWS), inputs, warmup, rounds,
                                                                  ROW_START_LIMIT_S)}
    inputs = None
    core.free_memory(device)
    ours = results["graphstep"]
    if "error" in ours:
        return [record(name, "error", f"graphstep's row did not run: {ours['error']}") for name in CHECKS]
    startup = {row: round(r["build_s"] + r["first_step_s"], 2) for row, r in results.items() if "build_s" in r}
    return [verdict(name, peer, results[peer], ours, startup, is_cuda(device)) for peer, name in zip(PEER_ROWS, CHECKS)]


def verdict(name: str, peer: str, row: dict, ours: dict, startup: dict, on_gpu: bool) -> dict:
    """One peer's row against graphstep's (both as perf/bench_peers.py's ``run_shape`` returns them)."""
    if "error" in row:
        missing = "heavyball does not import here" in row["error"]  # not installed: skipped; broken: an error
        status = f"skipped: {row['error']}" if missing else "error"
        return record(name, status, row["error"], build_and_first_step_s=startup)
    goal, peer_bytes = _goal(peer)
    speedup = row["vs_graphstep"]
    detail = (f"{row['label']} ({peer_bytes} B/param) {row['median_ms']:.3f} ms / graphstep's default step "
              f"({CLIPPED_BYTES} B/param) {ours['median_ms']:.3f} ms = {speedup:.2f}x faster [95% interval "
              f"{row['vs_graphstep_low']:.2f}-{row['vs_graphstep_high']:.2f}] (goal >= {goal:.2f}x); build + first "
              f"step {startup[peer]:.1f} s against graphstep's {startup['graphstep']:.1f} s")
    numbers = {"peer_ms": row["median_ms"], "graphstep_ms": ours["median_ms"], "speedup": speedup, "goal": goal,
               "build_and_first_step_s": startup, "peer_notes": row.get("notes", "")}
    if not on_gpu:
        return record(name, NO_CUDA, "CPU for reference: " + detail, **numbers)
    return record(name, "pass" if speedup >= goal else "fail", detail, **numbers)
