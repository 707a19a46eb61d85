"""What the command line's flags accept, where its output goes by default, and its version.

The argument types raise ``argparse.ArgumentTypeError`` with a message for every bad value, so argparse
prints "argument --steps: must be a positive integer, got 'many'" rather than the name of a Python
function, and a bad ``--device`` is a one-line usage error (exit status 2), not a traceback from deep
inside the training run. Every subcommand takes ``--device`` from ``add_device_argument``: one flag, one
default ("auto"), one check.
"""

from __future__ import annotations

import argparse
import getpass
import math
import re
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Optional

import torch
from capture.devices import accelerator_available

# The root of the checkout this package was imported from (graphstep/app/options.py -> three levels up);
# in an installed (non-editable) copy it is site-packages, which has neither file looked for below.
_CHECKOUT = Path(__file__).resolve().parents[2]


def _integer_at_least(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _integer_at_least(text, 1, "a positive integer")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    return _integer_at_least(text, 0, "a non-negative integer")


AUTO_DEVICE = "auto"
DEVICE_HELP = ("where to run: auto (default: the accelerator torch finds, e.g. cuda, else cpu), cpu, cuda, "
               "cuda:1, mps, ...; a device this torch cannot use is refused before anything runs")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device``, the same in every subcommand; ``resolve_device`` turns its value into a device."""
    parser.add_argument("--device", type=torch_device, default=AUTO_DEVICE, help=DEVICE_HELP)


def resolve_device(name: str) -> str:
    """``name`` as a torch device string; "auto" is the accelerator torch finds (``torch.accelerator``),
    else "cpu"."""
    if name != AUTO_DEVICE:
        return name
    if accelerator_available():
        return str(torch.accelerator.current_accelerator())
    return "cpu"


def torch_device(text: str) -> str:
    """A device this process can allocate on, as torch spells it ("cpu", "cuda:0", ...), or "auto" (see
    ``resolve_device``).

    Parsing alone would accept a device this build of torch cannot use (an accelerator it was not built
    for, a GPU index past the last one); allocating an empty tensor there finds out before any training.
    """
    if text == AUTO_DEVICE:
        return text
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (examples: cpu, cuda, cuda:1, mps)") \
            from None
    try:
        torch.empty(0, device=device)
    except Exception as exc:  # whatever the backend raises (AssertionError, RuntimeError): say it in one line
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise argparse.ArgumentTypeError(f"device {text!r} is not usable here: {reason}") from None
    return str(device)


def out_help(kind: str, file: str) -> str:
    """``--out``'s help: the rule of ``default_out_dir``, then where it lands from here."""
    here = str(default_out_dir(kind)).replace("%", "%%")  # argparse %-formats help strings
    return (f"folder for {file} (default: out/{kind} when run from the root of a graphstep checkout, else "
            f"graphstep-<user>/{kind} in the system temp dir; here: {here})")


def default_out_dir(kind: str) -> Path:
    """Where ``graphstep <kind>`` writes when not told: ``out/<kind>`` when run from the root of a graphstep
    checkout (its .gitignore covers out/), else a graphstep folder of the system temp dir; never an
    untracked folder in someone's working tree."""
    if Path.cwd().resolve() == _CHECKOUT and _ignores_out(_CHECKOUT / ".gitignore"):
        return Path("out") / kind
    return Path(tempfile.gettempdir()) / f"graphstep-{_user()}" / kind


def _ignores_out(gitignore: Path) -> bool:
    try:
        lines = gitignore.read_text().splitlines()
    except OSError:
        return False
    return any(line.strip() in ("out", "out/", "/out", "/out/") for line in lines)


def _user() -> str:
    """The login name, so two users of one machine do not share (or fight over) a temp folder."""
    try:
        return getpass.getuser()
    except Exception:  # no name for this uid (some containers)
        return "user"


def package_version() -> str:
    """The installed distribution's version; from a checkout that is not installed, its pyproject.toml's."""
    try:
        return metadata.version("graphstep")
    except metadata.PackageNotFoundError:
        pass
    return _pyproject_version(_CHECKOUT / "pyproject.toml") or "unknown (not installed, no pyproject.toml)"


def _pyproject_version(pyproject: Path) -> Optional[str]:
    try:
        text = pyproject.read_text()
    except OSError:
        return None
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
    return match.group(1) if match else None
