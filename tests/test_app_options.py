"""graphstep.app.options: where the app writes when not told, and what its flags accept."""

import argparse
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from graphstep.app import cli
from graphstep.app.options import default_out_dir, package_version, positive_float, positive_int, torch_device

CHECKOUT = Path(__file__).resolve().parents[1]


@pytest.fixture
def private_tempdir(tmp_path, monkeypatch):
    """tempfile.gettempdir() answers a folder of this test, so nothing lands in the real temp dir."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return temp


def test_default_out_dir_in_a_checkout_is_the_ignored_out_folder(monkeypatch):
    monkeypatch.chdir(CHECKOUT)
    assert default_out_dir("demo") == Path("out") / "demo"
    # the claim behind it: the checkout's .gitignore ignores out/ at its root
    assert "/out/" in (CHECKOUT / ".gitignore").read_text().splitlines()


def test_default_out_dir_elsewhere_is_the_temp_dir(tmp_path, monkeypatch, private_tempdir):
    monkeypatch.chdir(tmp_path)
    where = default_out_dir("profile")
    assert where.parent.parent == private_tempdir and where.name == "profile"
    assert where.parent.name.startswith("graphstep-")


def test_demo_without_out_writes_where_it_says(tmp_path, monkeypatch, private_tempdir, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--steps", "2", "--batch-size", "2", "--capture", "eager", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    png = default_out_dir("demo") / "loss.png"
    assert png.parent.parent.parent == private_tempdir
    assert f"output: {png} (--out DIR to choose)" in out and f"loss curve: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(tmp_path.iterdir()) == [private_tempdir]  # nothing written into the working directory


def test_demo_without_matplotlib_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert cli.main(["demo", "--steps", "2", "--batch-size", "2", "--capture", "eager", "--threads", "1",
                     "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "matplotlib" in line]
    assert lines == ["output: no loss-curve PNG, matplotlib is not installed (pip install 'graphstep[app]')"]
    assert "loss curve:" not in out and not list(tmp_path.iterdir())


def test_argument_types_accept_good_values_and_explain_bad_ones():
    assert positive_int("3") == 3 and positive_float("2.5e-3") == 2.5e-3
    assert torch_device("cpu") == "cpu" and torch_device("cpu:0") == "cpu:0"
    for convert, text in [(positive_int, "0"), (positive_int, "1.5"), (positive_float, "nan"),
                          (positive_float, "inf"), (positive_float, "0"), (torch_device, "gpu")]:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
            convert(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
def test_a_device_torch_parses_but_cannot_use_is_refused():
    with pytest.raises(argparse.ArgumentTypeError, match="'cuda' is not usable here"):
        torch_device("cuda")


def test_package_version_matches_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(CHECKOUT / "pyproject.toml", "rb") as f:
        assert package_version() == tomllib.load(f)["project"]["version"]
