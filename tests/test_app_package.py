"""graphstep.app stays out of the core: `import graphstep` loads neither the app nor matplotlib, no core module
imports the app, and the app names no device type (capture.devices decides, docs/design.md law 7)."""

import os
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "graphstep"


def test_import_graphstep_loads_neither_the_app_nor_matplotlib():
    # (tqdm is not checked: torch 2.13 itself imports it)
    probe = ("import sys, graphstep; "
             "print(sorted(m for m in sys.modules if m.startswith(('matplotlib', 'graphstep.app'))))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_no_core_module_imports_the_app():
    # __main__.py is `python -m graphstep`, the command line itself: running it is asking for the app, and
    # `import graphstep` never executes it.
    core = [p for p in PACKAGE.rglob("*.py") if "app" not in p.relative_to(PACKAGE).parts[:1]
            and p.name != "__main__.py"]
    assert len(core) > 10
    pattern = re.compile(r"graphstep\.app|from \.+app\b|from \.+ import [^\n]*\bapp\b")
    offenders = [str(p.relative_to(PACKAGE)) for p in core if pattern.search(p.read_text())]
    assert offenders == []


def test_the_app_has_no_device_type_literal():
    sources = list((PACKAGE / "app").glob("*.py"))
    assert len(sources) >= 6
    literal = re.compile(r"[\"']cuda[\"']")
    assert [str(p.name) for p in sources if literal.search(p.read_text())] == []
