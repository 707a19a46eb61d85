"""perf/bench_peers.py's smoke path, so the peers' benchmark cannot rot: tiny shapes, the rows that compile
nothing (graphstep picks "fused" below its compile threshold), heavyball where it is installed (else its row
says why), and one row of the startup table in fresh processes. No timing is asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "perf"))

import bench_peers  # noqa: E402
import peer_pipelines  # noqa: E402
import peer_startup  # noqa: E402
from graphstep.app import bench_core as core  # noqa: E402
from graphstep.app import bench_shapes  # noqa: E402


def test_interleaved_rows_and_a_missing_peer_say_what_ran(tmp_path, capsys):
    out = tmp_path / "peers.json"
    rows = "graphstep,torch-fused-clip,heavyball,floor"
    assert bench_peers.main(["--shapes", "tiny", "--rows", rows, "--rounds", "2", "--warmup", "1", "--no-startup",
                             "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    shape = result["shapes"]["16 x 1,024"]
    by_row = {r["row"]: r for r in shape["rows"]}
    assert list(by_row) == rows.split(",")
    for row in ("graphstep", "torch-fused-clip", "floor"):
        assert len(by_row[row]["times_ms"]) == 2 and by_row[row]["median_ms"] > 0, by_row[row]
    assert by_row["graphstep"]["vs_graphstep"] == 1.0
    heavyball = by_row["heavyball"]
    if peer_pipelines.heavyball_problem():
        assert "heavyball does not import here" in heavyball["error"]
    else:
        assert heavyball["median_ms"] > 0
    table = capsys.readouterr().out
    assert "| torch clip_grad_norm_ + AdamW(fused=True) |" in table and "heavyball" in table


def test_startup_row_runs_cold_then_warm():
    results = peer_startup.startup_rows(["torch-fused-clip"], "gpt2-quick", timeout_s=300)
    assert [r["cache"] for r in results] == ["cold", "warm"]
    for r in results:
        assert "error" not in r, r
        assert r["build_s"] >= 0 and r["first_step_s"] > 0
    table = peer_startup.markdown(results, peer_pipelines.LABELS, "gpt2-quick")
    assert table.count("| torch clip_grad_norm_ + AdamW(fused=True) |") == 2


def test_the_warm_row_waits_for_a_compile_the_cold_process_left_running(tmp_path):
    import threading

    folder = tmp_path / "graphstep_native"
    folder.mkdir()
    partial = folder / "library.so.partial"
    partial.write_text("")
    threading.Timer(0.5, partial.unlink).start()  # the compiler finishes and moves its output into place
    assert 0.4 < peer_startup.wait_for_left_compiles(str(tmp_path), limit_s=60, poll_s=0.02) < 60
    partial.write_text("")  # one that never finishes is waited for only up to the limit
    assert peer_startup.wait_for_left_compiles(str(tmp_path), limit_s=0.2, poll_s=0.02) >= 0.2
    assert peer_startup.wait_for_left_compiles(str(tmp_path / "no cache"), limit_s=60) < 1


def test_a_row_that_does_not_start_in_time_is_given_up_and_the_others_run(monkeypatch):
    def spins(inputs, grads):  # a compile that does not finish
        while True:
            pass

    def swallows(inputs, grads):  # a library that catches the limit's exception and goes on
        try:
            while True:
                pass
        except bench_peers.StartTooSlow:
            pass
        return peer_pipelines.build_torch_fused_clip(inputs, grads)

    monkeypatch.setitem(peer_pipelines.BUILDERS, "torch-compiled", spins)
    monkeypatch.setitem(peer_pipelines.BUILDERS, "heavyball", swallows)
    inputs = core.Inputs(bench_shapes.many_tensors(16, 1024), torch.device("cpu"))
    results = bench_peers.run_shape(["torch-fused-clip", "torch-compiled", "heavyball", "floor"], inputs, 1, 2,
                                    start_limit_s=1.0)
    by_row = {r["row"]: r for r in results}
    for row in ("torch-compiled", "heavyball"):
        assert by_row[row]["error"] == "StartTooSlow: build and first step not finished within 1 s (given up)"
        assert "times_ms" not in by_row[row]
    for row in ("torch-fused-clip", "floor"):
        assert len(by_row[row]["times_ms"]) == 2, by_row[row]
