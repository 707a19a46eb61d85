"""`graphstep demo` in-process: it trains (the loss falls) and refuses bad arguments like argparse does."""

import math
import re

import pytest

from graphstep import cli

SUMMARY = re.compile(r"final loss (\S+) \(first (\S+),.*median (\S+) ms/step, (\d+) steps skipped")


def run(capsys, *argv):
    assert cli.main(list(argv)) == 0
    out = capsys.readouterr().out
    match = SUMMARY.search(out)
    assert match, out
    final, first, median_ms, skipped = match.groups()
    return float(final), float(first), float(median_ms), int(skipped), out


def test_demo_loss_falls(capsys):
    final, first, median_ms, skipped, out = run(capsys, "demo", "--steps", "20", "--preset", "tiny")
    assert math.isfinite(final) and math.isfinite(first)
    assert final < first, out
    assert median_ms > 0 and skipped == 0
    assert out.count("ms/step") >= 3  # step 1, every steps/10, and the summary


def test_demo_sgd_captured(capsys):
    final, first, _, skipped, out = run(capsys, "demo", "--steps", "8", "--optimizer", "sgd", "--capture", "graph",
                                        "--batch-size", "4", "--log-every", "4")
    assert math.isfinite(final) and final < first, out
    assert skipped == 0
    assert "optimizer step ran replay" in out


@pytest.mark.parametrize("argv", [
    [],
    ["frobnicate"],
    ["demo", "--precision", "fp8"],
    ["demo", "--steps", "0"],
    ["demo", "--steps", "many"],
    ["demo", "--lr", "-1"],
    ["demo", "--preset", "huge"],
    ["demo", "--capture", "always"],
    ["demo", "--no-such-flag"],
])
def test_bad_arguments_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "usage: graphstep" in capsys.readouterr().err


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    assert "--precision" in capsys.readouterr().out


def test_warmup_cosine_schedule():
    factor = cli.warmup_cosine(steps=100, warmup=10, floor=0.1)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(1.0)
    assert factor(100) == pytest.approx(0.1) and factor(1000) == pytest.approx(0.1)
    assert all(factor(s) >= factor(s + 1) for s in range(10, 100))


def test_bench_script_is_found_in_a_checkout():
    script = cli.find_bench_script()
    assert script is not None and script.name == "bench_step.py"
