"""Spawn gloo ranks on 127.0.0.1, bounded in time, and the small model/data helpers the tests share.

``spawn(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes,
each in a gloo process group on a free port (tests/_ports.py), and returns the ranks' return values
(through files in a temporary directory). It never hangs: processes are joined against one deadline and
stragglers are killed. A rank that raised has its traceback re-raised in the parent. tests/conftest.py puts
tests/distributed on ``sys.path``: ``from _harness import spawn`` works from every test file.

The ranks are forked by multiprocessing's fork server, one per test session, which imported torch and
graphstep once: a rank starts in well under a second instead of the seconds a fresh interpreter takes to
import them, and still shares nothing with the ranks of earlier tests. Each rank takes the caller's
environment, working directory and ``sys.path`` as they are at the call, as a freshly spawned interpreter
would.

The model, data and metric helpers are tests/toy.py's, re-exported for the workers.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

from _ports import free_port


class RankFailed(AssertionError):
    pass


# Imported once by the fork server; every rank is forked from it.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "graphstep", "_harness"]


def _context():
    """A start method that is cheap where it exists: the fork server (Linux, macOS); spawn elsewhere."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts, at the session's first spawn
    return ctx


def _adopt_environment(environ: dict) -> None:
    """The calling test's environment: a forked rank has the fork server's, from the session's first spawn.
    (multiprocessing itself gives a rank the caller's working directory and ``sys.path`` before it unpickles
    the rank's function.)"""
    os.environ.clear()
    os.environ.update(environ)


def _entry(rank: int, world_size: int, port: int, outdir: str, environ: dict, fn, args) -> None:
    _adopt_environment(environ)
    torch.set_num_threads(1)
    import torch.distributed as dist

    path = os.path.join(outdir, f"rank{rank}.pkl")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=60))
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # report everything, including CollectiveError the test expects
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    # No destroy_process_group: with a dead peer it can block. The parent reads the file.
    os._exit(0)


def spawn(fn, world_size: int, *args, timeout: float = 50.0, allow_missing: tuple = ()) -> list:
    """[(status, value)] per rank: status "ok" (value = fn's return) or "error" (value = traceback text);
    ``None`` for ranks in ``allow_missing`` that wrote nothing (killed on purpose)."""
    ctx = _context()
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        environ = dict(os.environ)
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, outdir, environ, fn, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        expected = [r for r in range(world_size) if r not in allow_missing]
        while time.monotonic() < deadline:
            if all(os.path.exists(os.path.join(outdir, f"rank{r}.pkl")) for r in expected):
                break
            time.sleep(0.05)
        for r, p in enumerate(procs):
            grace = 0.5 if r in allow_missing else 5.0  # a rank killed or hung on purpose: do not wait long
            p.join(timeout=max(0.0, min(grace, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results = []
        for r in range(world_size):
            path = os.path.join(outdir, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            elif r in allow_missing:
                results.append(None)
            else:
                raise RankFailed(f"rank {r} of {world_size} wrote no result within {timeout:.0f} s "
                                 f"(exit code {procs[r].exitcode})")
        return results


def values(results: list) -> list:
    """The return values, raising the first rank's error."""
    for rank, result in enumerate(results):
        if result is not None and result[0] == "error":
            raise RankFailed(f"rank {rank} raised:\n{result[1]}")
    return [None if r is None else r[1] for r in results]


# ---- model and data: the one copy lives in tests/toy.py (tests/conftest.py puts tests/ on sys.path,
# and spawned ranks inherit the parent's sys.path) ------------------------------------------------------
from toy import GLOBAL_BATCH, VOCAB, batch, local_loss, relative_drift, relative_error, tiny_transformer  # noqa: E402,F401
