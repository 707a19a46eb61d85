"""What the command line's flags accept, where its output goes by default, and its version.

The argument types raise ``argparse.ArgumentTypeError`` with a message for every bad value, so argparse
prints "argument --steps: must be a positive integer, got 'many'" rather than the name of a Python
function, and a bad ``--device`` is a one-line usage error (exit status 2), not a traceback from deep
inside the training run.
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

# The root of the checkout this package was imported from (graphstep/app/options.py -> three levels up);
# in an installed (non-editable) copy it is site-packages, which has neither file looked for below.
_CHECKOUT = Path(__file__).resolve().parents[2]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def torch_device(text: str) -> str:
    """A device this process can allocate on, as torch spells it ("cpu", "cuda:0", ...).

    Parsing alone would accept a device this build of torch cannot use (an accelerator it was not built
    for, a GPU index past the last one); allocating an empty tensor there finds out before any training.
    """
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
