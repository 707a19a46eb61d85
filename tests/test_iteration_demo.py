"""``graphstep demo --scope iteration``: the built-in GPT trained with the whole iteration captured (gs.Iteration),
eager then captured, reported bitwise equal; ``--scope step`` stays the default. (On 2 ranks the iteration is
tested in tests/distributed/test_iteration_distributed.py: a demo there would spawn two fresh interpreters.)"""

import re

import pytest

from graphstep.app import cli


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: the tiny model runs on one thread


def demo(capsys, tmp_path, *argv):
    assert cli.main(["demo", *argv, "--out", str(tmp_path), "--device", "cpu"]) == 0
    return capsys.readouterr().out


def test_demo_scope_iteration_reports_eager_and_captured_bitwise_equal(capsys, tmp_path):
    out = demo(capsys, tmp_path, "--scope", "iteration", "--steps", "4", "--batch-size", "4", "--log-every", "2")
    assert "capture of the whole iteration: eager then graph" in out
    assert re.search(r"^graph\s+replay\s", out, re.M), out
    assert "eager vs graph (replay): final losses equal, bitwise" in out and "NOT equal" not in out


def test_demo_scope_defaults_to_the_step():
    assert cli.settings_from(cli.build_parser().parse_args(["demo"])).scope == "step"
