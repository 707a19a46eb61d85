"""`graphstep demo` and `graphstep profile` from the command line (graphstep.app.cli): progress, summary, the
loss-curve PNG, eager and captured bitwise equal, data-parallel ranks bounded in time, argparse errors that
name no internal function, the time estimate and the output folder said up front."""

import io
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from graphstep.app import cli
from graphstep.app.demo import DemoSettings, Progress, ProgressBar, warmup_cosine
from graphstep.app.demo_dist import RankFailure, run_ranks

ROW = re.compile(r"^(eager|graph|auto)\s+(eager|replay|cuda)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+)\s+(\S+)$", re.M)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST = ["--steps", "20", "--preset", "tiny", "--batch-size", "8"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: the tiny model runs on one thread


def run(capsys, tmp_path, *argv, status=0):
    # --device cpu: these tests expect the CPU's replay backend and thread notes; the default, auto, would
    # pick a GPU where there is one
    assert cli.main(["demo", *argv, "--out", str(tmp_path), "--device", "cpu"]) == status
    out = capsys.readouterr().out
    rows = {m.group(1): dict(backend=m.group(2), final=float(m.group(3)), last=float(m.group(4)),
                             ms=float(m.group(5)), skipped=int(m.group(6)), scale=m.group(7))
            for m in ROW.finditer(out)}
    assert rows, out
    return rows, out


def test_demo_eager_and_captured_are_bitwise_equal(capsys, tmp_path):
    rows, out = run(capsys, tmp_path, *FAST)
    assert set(rows) == {"eager", "graph"}
    eager, graph = rows["eager"], rows["graph"]
    assert eager["backend"] == "eager" and graph["backend"] == "replay"
    assert eager["last"] == graph["last"] and eager["final"] == graph["final"]
    assert "final losses equal, bitwise" in out and "NOT equal" not in out
    assert all(math.isfinite(r["final"]) and r["ms"] > 0 and r["skipped"] == 0 and r["scale"] == "-"
               for r in rows.values())
    # progress: the first step, every steps/10 and the last, for each run (not a terminal: plain lines)
    assert out.count("eager step") == 11 and out.count("graph step") == 11 and "\r" not in out
    first = float(re.search(r"eager step\s+1/20\s+loss (\S+)", out).group(1))
    assert eager["final"] < first  # it learns
    png = tmp_path / "loss.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"loss curve: {png}" in out
    # said up front, before the first progress line: how long, and where the PNG goes
    intro = out[:out.index("eager step")]
    assert re.search(r"^time: about \d+ (s|min) \(2 x 20 steps", intro, re.M), intro
    assert f"output: {png} (--out DIR to choose)" in intro


def test_demo_single_run_sgd_captured(capsys, tmp_path):
    rows, out = run(capsys, tmp_path, "--steps", "8", "--optimizer", "sgd", "--capture", "graph",
                    "--batch-size", "4", "--log-every", "4", "--threads", "1")
    assert "on cpu (1 thread)" in out
    assert list(rows) == ["graph"] and rows["graph"]["backend"] == "replay"
    assert "bitwise" not in out  # nothing to compare against
    assert out.count("graph step") == 3  # steps 1, 4, 8
    assert (tmp_path / "loss.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("load, threads", [(9.0, 1), (0.2, 2)])
def test_demo_takes_one_thread_when_the_cores_are_busy(load, threads, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    torch.set_num_threads(2)  # torch's default on two cores (the autouse fixture restores the count)
    rows, out = run(capsys, tmp_path, "--steps", "2", "--batch-size", "2", "--capture", "eager")
    assert torch.get_num_threads() == threads
    assert f"on cpu ({threads} thread{'s' * (threads > 1)})" in out
    busy = "note: the 2 cores are busy (1-min load average 9.0), so 1 intra-op thread: 2 would wait"
    assert (busy in out) == (threads == 1), out


def test_demo_fp16_reports_the_loss_scale(capsys, tmp_path):
    rows, out = run(capsys, tmp_path, "--steps", "4", "--precision", "fp16", "--batch-size", "2")
    assert rows["eager"]["scale"] == rows["graph"]["scale"] == "65536"
    assert "scale 65536" in out and "final losses equal, bitwise" in out


def test_demo_with_fp8_moments_stores_them_so_and_captures_bitwise(capsys, tmp_path):
    from graphstep.app.demo import DemoSettings, optimizer_config
    config = optimizer_config(DemoSettings(moments="fp8"), "eager")
    assert config.use_precision_aware_optimizer and config.exp_avg_dtype == config.exp_avg_sq_dtype == torch.uint8
    rows, out = run(capsys, tmp_path, "--steps", "4", "--moments", "fp8", "--batch-size", "2")
    assert "final losses equal, bitwise" in out and all(math.isfinite(r["final"]) for r in rows.values())


def test_demo_world_size_2_is_bounded_and_summarized(capsys, tmp_path):
    # Bounded by the demo's own --timeout (it raises past it), not by a wall-clock assertion here.
    rows, out = run(capsys, tmp_path, "--steps", "6", "--batch-size", "4", "--world-size", "2",
                    "--timeout", "90")
    assert set(rows) == {"eager", "graph"} and rows["graph"]["backend"] == "replay"
    assert "params bitwise identical on all 2 ranks: True" in out
    assert "final losses equal, bitwise" in out
    assert "2 gloo ranks x 2" in out and out.count("eager step") == 6  # rank 0 reports every step


def test_a_failing_rank_is_named_not_waited_for():
    # "raised" (its traceback came back), not "wrote no result within ..." (the deadline ran out).
    with pytest.raises(RankFailure, match=r"rank \d of 2 raised"):
        run_ranks(DemoSettings(steps=2, batch_size=2, device="no-such-device"), ["eager"], 2, every=1,
                  deadline_s=60)


def test_world_size_must_divide_the_batch(capsys, tmp_path):
    assert cli.main(["demo", "--world-size", "3", "--batch-size", "4", "--out", str(tmp_path)]) == 2
    assert "multiple of --world-size 3" in capsys.readouterr().err


def test_progress_bar_rewrites_one_line_on_a_terminal():
    stream = io.StringIO()
    bar = ProgressBar(stream, tty=True)
    assert bar.tty_every(300, 30) == 3
    for step in (1, 150, 300):
        bar(Progress("graph", step, 300, 2.5, 40.0, 1e-3, 1024.0))
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "300/300" in text and "scale 1024" in text and "40.0 ms/step" in text


def test_profile_writes_a_trace_and_prints_the_nvml_line(capsys, tmp_path):
    assert cli.main(["profile", "--steps", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    trace = tmp_path / "trace.json"
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"graphstep.step", "graphstep.update"} <= names
    assert f"trace: {trace}" in out and "graphstep.update" in out
    if not torch.cuda.is_available():
        assert "no NVIDIA GPU (NVML not found)" in out


@pytest.mark.parametrize("argv", [
    [],
    ["frobnicate"],
    ["demo", "--precision", "fp4"],
    ["demo", "--steps", "0"],
    ["demo", "--steps", "many"],
    ["demo", "--lr", "-1"],
    ["demo", "--preset", "huge"],
    ["demo", "--capture", "always"],
    ["demo", "--world-size", "0"],
    ["demo", "--threads", "0"],
    ["demo", "--no-such-flag"],
    ["profile", "--capture", "both"],
    ["profile", "--steps", "0"],
    ["demo", "--lr", "fast"],
    ["demo", "--moments", "fp4"],
    ["demo", "--timeout", "-3"],
    ["demo", "--device", "gpu"],
    ["profile", "--device", "no-such-device:0"],
    ["profile", "--batch-size", "eight"],
])
def test_bad_arguments_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: graphstep" in err
    # one "error:" line, in the user's terms: no Python function name such as `invalid _positive_int value`
    assert len([line for line in err.splitlines() if "error:" in line]) == 1, err
    assert not re.search(r"(?<![\w-])_[a-z]\w*", err), err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["demo", "--steps", "many"], "argument --steps: must be a positive integer, got 'many'"),
    (["demo", "--lr", "fast"], "argument --lr: must be a positive number, got 'fast'"),
    (["demo", "--device", "gpu"], "argument --device: 'gpu' is not a torch device"),
    # parses as a device, but this process cannot allocate there (no such GPU, or a CPU-only torch)
    (["demo", "--device", "cuda:999"], "argument --device: device 'cuda:999' is not usable here: "),
    (["profile", "--device", "gpu"], "argument --device: 'gpu' is not a torch device"),
])
def test_bad_values_get_a_one_line_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"graphstep {argv[0]}: error: {message}"), last


def test_version_is_the_package_version(capsys):
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"graphstep {version}\n"


@pytest.mark.parametrize("command, flag", [("demo", "--world-size"), ("profile", "--capture")])
def test_help_exits_cleanly(command, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert flag in capsys.readouterr().out


def test_warmup_cosine_schedule():
    factor = warmup_cosine(steps=100, warmup=10, floor=0.1)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(1.0)
    assert factor(100) == pytest.approx(0.1) and factor(1000) == pytest.approx(0.1)
    assert all(factor(s) >= factor(s + 1) for s in range(10, 100))


def test_demo_trains_with_muon_and_qk_clip_bitwise_equal_captured(capsys, tmp_path):
    rows, out = run(capsys, tmp_path, "--steps", "4", "--optimizer", "muon", "--qk-clip", "--batch-size", "2")
    assert set(rows) == {"eager", "graph"} and rows["graph"]["backend"] == "replay"
    assert "final losses equal, bitwise" in out and "muon lr 0.003" in out and "qk-clip at 20" in out



def test_demo_fp8_trains_captured_like_eager_and_reports_param_bytes(capsys, tmp_path):
    rows, out = run(capsys, tmp_path, "--steps", "6", "--precision", "fp8", "--batch-size", "4")
    assert set(rows) == {"eager", "graph"} and rows["graph"]["backend"] == "replay"
    assert "final losses equal, bitwise" in out and all(r["skipped"] == 0 for r in rows.values())
    intro = out[:out.index("eager step")]
    line = re.search(r"^param bytes: .* fp8 weights .* \(([\d,]+) elements at 1 B.*all in bf16: .* \((\S+)x\)$",
                     intro, re.M)
    assert line, intro
    assert int(line.group(1).replace(",", "")) > 0 and float(line.group(2)) < 0.75  # fp8 halves the big weights
