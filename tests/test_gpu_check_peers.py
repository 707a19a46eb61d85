"""perf/gpu_check_peers.py, the GPU check's ``--peers`` part: each verdict can fail (a clipped peer ahead of
graphstep, an unclipped one ahead by more than the norm's bytes), a peer that is not installed is skipped saying
why while a peer that breaks is an error, and every goal names the bytes it comes from. The part itself runs
end to end in tests/test_gpu_check.py (``--cpu --peers``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))

import gpu_check_peers as peers_part  # noqa: E402

OURS = {"row": "graphstep", "median_ms": 10.0}
STARTUP = {"graphstep": 1.0, "torch-compiled-clip": 60.0, "torch-compiled": 20.0, "heavyball-clip": 30.0}


def _peer(row: str, median_ms: float) -> dict:
    ratio = median_ms / OURS["median_ms"]
    return {"row": row, "label": row, "median_ms": median_ms, "vs_graphstep": ratio,
            "vs_graphstep_low": ratio * 0.95, "vs_graphstep_high": ratio * 1.05}


def _verdict(peer: str, row: dict, on_gpu: bool = True) -> dict:
    return peers_part.verdict(f"peers-default-vs-{peer}", peer, row, OURS, STARTUP, on_gpu)


def test_a_clipped_peer_must_be_behind_graphstep():
    assert _verdict("torch-compiled-clip", _peer("torch-compiled-clip", 12.0))["status"] == "pass"
    ahead = _verdict("torch-compiled-clip", _peer("torch-compiled-clip", 9.0))
    assert ahead["status"] == "fail" and "goal >= 1.00x" in ahead["detail"]


def test_an_unclipped_peer_may_lead_by_no_more_than_the_norms_bytes():
    # graphstep's clipped step reads 32 B/param, the unclipped peer 28: the goal is 0.9 x 28/32 = 0.79
    goal, peer_bytes = peers_part._goal("torch-compiled")
    assert peer_bytes == 28 and abs(goal - 0.9 * 28 / 32) < 1e-12
    assert _verdict("torch-compiled", _peer("torch-compiled", 8.5))["status"] == "pass"
    assert _verdict("torch-compiled", _peer("torch-compiled", 7.0))["status"] == "fail"


def test_every_goal_names_its_bytes_and_the_compile_times():
    detail = _verdict("torch-compiled-clip", _peer("torch-compiled-clip", 12.0))["detail"]
    assert detail.count("B/param") == 2 and "build + first step 60.0 s against graphstep's 1.0 s" in detail


def test_on_the_cpu_the_rows_are_for_reference_only():
    row = _verdict("torch-compiled-clip", _peer("torch-compiled-clip", 9.0), on_gpu=False)
    assert row["status"] == "skipped: no CUDA" and row["detail"].startswith("CPU for reference: ")


def test_a_missing_peer_is_skipped_and_a_broken_one_is_an_error():
    missing = _verdict("heavyball", {"row": "heavyball", "error": "RuntimeError: heavyball does not import here (x)"})
    assert missing["status"] == "skipped: RuntimeError: heavyball does not import here (x)"
    broken = _verdict("heavyball-clip", {"row": "heavyball-clip", "error": "TypeError: bad argument"})
    assert broken["status"] == "error" and broken["detail"] == "TypeError: bad argument"
    assert _verdict("torch-compiled", {"row": "torch-compiled", "error": "InductorError: x"})["status"] == "error"
