"""The command line as a newcomer meets it: one ``--device`` (same flag, default and refusal) in every
subcommand, a mistyped option answered with that subcommand's usage, help text without markup and with
every option explained, and the skipped steps of a run reported."""

import argparse
import re

import pytest
import torch

from graphstep.app import bench, cli
from graphstep.app.options import default_out_dir, resolve_device, torch_device

COMMANDS = ("demo", "profile", "bench")


def command_parsers() -> dict:
    """Each subcommand's own parser (bench's is the benchmark's, to which ``graphstep bench`` forwards)."""
    top = cli.build_parser()
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return {"demo": sub.choices["demo"], "profile": sub.choices["profile"], "bench": bench.build_parser()}


def help_of(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"] if command else ["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


# ---- --device ------------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
@pytest.mark.parametrize("command", COMMANDS)
def test_an_unusable_device_is_one_usage_line_in_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--device", "cuda"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.rstrip("\n").splitlines()[-1].startswith(
        f"graphstep {command}: error: argument --device: device 'cuda' is not usable here: "), err


def test_every_subcommand_has_the_same_device_flag():
    devices = {name: next(a for a in parser._actions if "--device" in a.option_strings)
               for name, parser in command_parsers().items()}
    assert {a.default for a in devices.values()} == {"auto"}
    assert len({a.help for a in devices.values()}) == 1 and len({a.type for a in devices.values()}) == 1
    assert all(a.type is torch_device for a in devices.values())


def test_auto_is_the_accelerator_else_the_cpu():
    assert torch_device("auto") == "auto"
    expected = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
    assert torch.device(resolve_device("auto")).type == expected
    assert resolve_device("cpu:0") == "cpu:0"


def test_the_demo_by_default_trains_where_auto_says(capsys, tmp_path):
    torch.set_num_threads(1)
    assert cli.main(["demo", "--steps", "1", "--batch-size", "2", "--capture", "eager", "--threads", "1",
                     "--out", str(tmp_path)]) == 0
    assert f"steps on {resolve_device('auto')}" in capsys.readouterr().out


# ---- usage and help ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", COMMANDS)
def test_a_mistyped_option_prints_the_subcommands_usage(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--stpes", "3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: graphstep {command} "), err
    assert f"graphstep {command}: error: unrecognized arguments: --stpes 3" in err


@pytest.mark.parametrize("command", ("", *COMMANDS))
def test_help_has_no_markup(command, capsys):
    text = help_of(command, capsys)
    assert "`" not in text and "::" not in text, text  # argparse prints help as written: no reST, no markdown


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_says_what_it_does(command):
    parser = command_parsers()[command]
    unexplained = [a.option_strings for a in parser._actions if not a.help]
    assert not unexplained, f"graphstep {command}: options without help: {unexplained}"


@pytest.mark.parametrize("command, file", [("demo", "loss.png"), ("profile", "trace.json")])
def test_out_help_states_the_rule_once_and_where_it_lands_here(command, file, capsys):
    text = " ".join(help_of(command, capsys).split())  # argparse wraps lines
    rule = (f"folder for {file} (default: out/{command} when run from the root of a graphstep checkout, else "
            f"graphstep-<user>/{command} in the system temp dir; here: {default_out_dir(command)})")
    assert rule in text, text


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--warmup", "-1"], ["--repeat", "0"], ["--threads", "0"]])
def test_bench_counts_are_checked_like_the_demos(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *argv])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.rstrip("\n").splitlines()[-1]
    assert re.match(rf"graphstep bench: error: argument {argv[0]}: must be a (positive|non-negative) integer, "
                    rf"got '{argv[1]}'", last), last
