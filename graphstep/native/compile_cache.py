"""A source of graphstep/native compiled once per machine into inductor's cache folder, and found there after.

``cached_library`` returns the path of the compiled shared library for a source and its compiler flags,
compiling it first where no process has (one process compiles while the others wait on a file lock; a process
that exits meanwhile leaves its compiler to finish and publish the library). The key is the source, the flags,
torch's and Python's builds: a new torch or a changed source compiles again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Optional

import torch

FOLDER = "graphstep_native"  # under inductor's cache folder


def cached_library(source: Path, name: str, flags: list[str], link_args: list[str], *,
                   torch_headers: bool, suffix: Optional[str] = None, includes: tuple = ()) -> Path:
    """The library ``source`` compiles into with ``flags`` (compiled now if no process has yet); raises where it
    cannot be built (no compiler, a compile error). ``name`` begins the file's name; ``suffix`` ends it (".so"
    if None); ``torch_headers``: compile against torch's and Python's headers; ``includes``: the headers of
    graphstep's own it includes (part of the key, as the source is)."""
    path = library_path(source, name, flags, suffix, includes)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path.with_suffix(".lock")) as lock:
            if not path.exists():  # another process may have built it while this one waited
                compile_library(source, path, flags, link_args, torch_headers=torch_headers, lock=lock)
    return path


def library_path(source: Path, name: str, flags: list[str], suffix: Optional[str] = None,
                 includes: tuple = ()) -> Path:
    """Where ``source`` (and the headers it ``includes``) compiled with ``flags`` for this torch and this Python
    lives."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    key = hashlib.sha256("\n".join([
        source.read_text(), *(header.read_text() for header in includes), torch.__version__,
        str(torch.version.git_version), sys.version, str(torch._C._GLIBCXX_USE_CXX11_ABI),
        " ".join(flags)]).encode()).hexdigest()[:16]
    return Path(cache_dir()) / FOLDER / f"{name}_{key}{suffix or '.so'}"


def compiler() -> str:
    """The machine's C++ compiler (``CXX``, else ``c++`` or ``g++`` on the path); raises where there is none."""
    found = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if found is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    return found


def compile_library(source: Path, path: Path, flags: list[str], link_args: list[str], *, torch_headers: bool,
                    lock: Optional[int] = None) -> None:
    """Compile ``source`` into ``path``, written whole or not at all: a reader never sees half a library.

    The compiler and the move into place run in one shell that also holds ``lock`` (a locked file's
    descriptor): a process that exits while it compiles (a test's rank, a short script) leaves the shell to
    finish and publish the library, and the next process waits for it instead of compiling again."""
    cxx = compiler()
    includes = []
    if torch_headers:
        from torch.utils.cpp_extension import include_paths
        includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    fd, partial = tempfile.mkstemp(dir=path.parent, suffix=".partial")
    os.close(fd)
    try:
        command = [cxx, *flags, *includes, str(source), "-o", partial, *link_args]
        script = f"{shlex.join(command)} && mv -f {shlex.quote(partial)} {shlex.quote(str(path))}"
        result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=600,
                                pass_fds=() if lock is None else (lock,))
        if result.returncode != 0:
            raise RuntimeError(f"{cxx} exited {result.returncode}: {result.stderr.strip()[-2000:]}")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)


@contextlib.contextmanager
def file_lock(path: Path):
    import fcntl
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield handle.fileno()  # released when every descriptor of it is closed: this one, and a compiler's
