"""param_checks.cpp compiled once per machine and torch, in the background, and loaded when it is ready.

The first call of ``loaded()`` in a process starts a thread that finds the library in the cache (inductor's
cache folder, keyed by the source, torch's and Python's builds) or compiles it there with the machine's C++
compiler against the running torch's headers (one process compiles while the others wait on a file lock; a
process that exits meanwhile leaves its compiler to finish). Until then, and wherever it cannot be built (no
compiler, no headers, or ``GRAPHSTEP_NATIVE_CHECKS=0``), ``loaded()`` returns None and the callers run the
same checks in Python: the library only makes them cheaper. ``status()`` says which, and why.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

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
        path = library_path()
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with _file_lock(path.with_suffix(".lock")) as lock:
                if not path.exists():  # another process may have built it while this one waited
                    compile_library(path, lock)
        build.module = _load(path)
        build.status = f"native: {path}"
    except Exception as error:  # noqa: BLE001 - any failure leaves the checks in Python, and says why
        build.status = f"python: the native checks could not be built ({type(error).__name__}: {error})"


def library_path() -> Path:
    """Where this source compiled for this torch and this Python lives."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    key = hashlib.sha256("\n".join([
        SOURCE.read_text(), torch.__version__, str(torch.version.git_version), sys.version,
        str(torch._C._GLIBCXX_USE_CXX11_ABI), " ".join(_flags())]).encode()).hexdigest()[:16]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return Path(cache_dir()) / "graphstep_native" / f"{MODULE_NAME}_{key}{suffix}"


def _flags() -> list[str]:
    return ["-O2", "-shared", "-fPIC", "-std=c++20", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def compile_library(path: Path, lock: Optional[int] = None) -> None:
    """Compile the source into ``path``, written whole or not at all: a reader never sees half a library.

    The compiler and the move into place run in one shell that also holds ``lock`` (a locked file's
    descriptor): a process that exits while it compiles (a test's rank, a short script) leaves the shell to
    finish and publish the library, and the next process waits for it instead of compiling again."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    from torch.utils.cpp_extension import include_paths
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    libraries = Path(torch.__file__).parent / "lib"
    fd, partial = tempfile.mkstemp(dir=path.parent, suffix=".partial")
    os.close(fd)
    try:
        command = [compiler, *_flags(), *includes, str(SOURCE), "-o", partial, f"-L{libraries}",
                   f"-Wl,-rpath,{libraries}", "-lc10", "-ltorch_cpu", "-ltorch_python"]
        script = f"{shlex.join(command)} && mv -f {shlex.quote(partial)} {shlex.quote(str(path))}"
        result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=600,
                                pass_fds=() if lock is None else (lock,))
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} exited {result.returncode}: {result.stderr.strip()[-2000:]}")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield handle.fileno()  # released when every descriptor of it is closed: this one, and a compiler's


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
