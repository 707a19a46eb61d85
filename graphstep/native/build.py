"""param_checks.cpp compiled once per machine and torch, in the background, and loaded when it is ready.

The first call of ``loaded()`` in a process starts a thread that finds the library in the cache or compiles it
there with the machine's C++ compiler against the running torch's headers (compile_cache.py: keyed by the
source, torch's and Python's builds; one process compiles while the others wait). Until then, and wherever it
cannot be built (no compiler, no headers, or ``GRAPHSTEP_NATIVE_CHECKS=0``), ``loaded()`` returns None and the
callers run the same checks in Python: the library only makes them cheaper. ``status()`` says which, and why.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sysconfig
import threading
from pathlib import Path
from typing import Optional

import torch

from . import compile_cache

SOURCE = Path(__file__).with_name("param_checks.cpp")
MODULE_NAME = "graphstep_param_checks"  # the name PyInit_ in the source declares
DISABLE_VARIABLE = "GRAPHSTEP_NATIVE_CHECKS"


class _Build:
    """This process's build: ``module`` once loaded, ``status`` as ``status()`` reports it."""

    def __init__(self):
        self.pid = os.getpid()
        self.thread: Optional[threading.Thread] = None
        self.module = None
        self.status = "not started: no step has run"


_build = _Build()
_lock = threading.Lock()
_python_only = False


def loaded():
    """The compiled module, or None while it builds or where it cannot (the callers then check in Python)."""
    if _python_only:
        return None
    module = _build.module
    if module is not None:
        return module
    _start()
    return _build.module


@contextlib.contextmanager
def python_only():
    """Within, ``loaded()`` returns None: the checks run in Python (to compare the two, or to test either)."""
    global _python_only
    was, _python_only = _python_only, True
    try:
        yield
    finally:
        _python_only = was


def wait(timeout: Optional[float] = None):
    """``loaded()``, after waiting up to ``timeout`` seconds for a build in progress (tests, benchmarks)."""
    _start()
    thread = _build.thread
    if thread is not None:
        thread.join(timeout)
    return _build.module


def status() -> str:
    """"native: <library>" once loaded; else what is happening or why it is not used."""
    return _build.status


def _start() -> None:
    global _build
    with _lock:
        if _build.pid != os.getpid():  # a forked child: the parent's thread did not come along, its library did
            parent, _build = _build, _Build()
            if parent.module is not None:
                _build.module, _build.status = parent.module, parent.status
        if _build.thread is not None or _build.module is not None:
            return
        if os.environ.get(DISABLE_VARIABLE, "1") == "0":
            _build.status = f"python: {DISABLE_VARIABLE}=0"
            return
        _build.status = "python: building the native checks"
        _build.thread = threading.Thread(target=_build_and_load, args=(_build,), name="graphstep-native-checks",
                                         daemon=True)
        _build.thread.start()


def _build_and_load(build: _Build) -> None:
    try:
        path = compile_cache.cached_library(SOURCE, MODULE_NAME, _flags(), _link_args(), torch_headers=True,
                                            suffix=_suffix())
        build.module = _load(path)
        build.status = f"native: {path}"
    except Exception as error:  # noqa: BLE001 - any failure leaves the checks in Python, and says why
        build.status = f"python: the native checks could not be built ({type(error).__name__}: {error})"


def _suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def _flags() -> list[str]:
    return ["-O2", "-shared", "-fPIC", "-std=c++20", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def _link_args() -> list[str]:
    libraries = Path(torch.__file__).parent / "lib"
    return [f"-L{libraries}", f"-Wl,-rpath,{libraries}", "-lc10", "-ltorch_cpu", "-ltorch_python"]


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
