"""``graphstep demo --world-size N``: N gloo ranks on 127.0.0.1, each training on its slice of each global
batch with the distributed optimizer (``use_distributed_optimizer=True``).

The ranks are fresh processes (torch.multiprocessing "spawn"). Rank 0 sends its progress reports and every
rank sends its results to the parent through one queue, so the parent prints everything to its own stream.
Bounded: a rank that dies (or raises) ends the run with a ``RankFailure`` naming it, the ranks' collectives
time out after ``distributed_timeout_s``, and the whole run after ``deadline_s``.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from typing import Callable, Optional, Sequence

from .demo import DemoSettings, Progress, RunResult, train


class RankFailure(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, settings: DemoSettings, captures: Sequence[str],
               every: int, messages) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=settings.timeout_s))
        report = (lambda p: messages.put(("progress", rank, p))) if rank == 0 else None
        for capture in captures:
            # Plain pickle: torch.multiprocessing would share the tensors' memory with a process about to exit.
            messages.put(("result", rank, pickle.dumps(train(settings, capture, report, every, rank, world_size))))
        messages.put(("done", rank, None))
    except BaseException as exc:  # the parent names the rank and shows its traceback
        messages.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    messages.close()
    messages.join_thread()  # flush the queue's feeder thread: os._exit would drop what it still holds
    # No destroy_process_group: with a dead peer it can block. The parent has everything it needs.
    os._exit(0)


def run_ranks(settings: DemoSettings, captures: Sequence[str], world_size: int, every: int,
              report: Optional[Callable[[Progress], None]] = None, deadline_s: float = 600.0) -> list[RunResult]:
    """Rank 0's RunResult per capture mode (losses are the global batch's), after all ranks finished."""
    import torch.multiprocessing as mp

    if settings.batch_size % world_size:
        raise ValueError(f"--batch-size {settings.batch_size} must be a multiple of --world-size {world_size}: "
                         f"each rank trains on an equal slice of each global batch")
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, settings, tuple(captures), every, messages),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: list[RunResult] = []
    done: set[int] = set()

    def handle(kind, rank, payload) -> None:
        if kind == "progress" and report is not None:
            report(payload)
        elif kind == "result" and rank == 0:
            results.append(pickle.loads(payload))
        elif kind == "done":
            done.add(rank)
        elif kind == "error":
            # A rank killed outright (exit code < 0) makes its peers' collectives fail: name it first.
            time.sleep(0.5)
            dead = [f"rank {r} died (exit code {p.exitcode})" for r, p in enumerate(procs)
                    if r != rank and not p.is_alive() and p.exitcode not in (0, None)]
            raise RankFailure(f"{'; '.join(dead) + '; then ' if dead else ''}rank {rank} of {world_size} raised:\n"
                              f"{payload}")

    deadline = time.monotonic() + deadline_s
    try:
        while len(done) < world_size:
            try:
                handle(*messages.get(timeout=0.2))
                continue
            except queue_module.Empty:
                pass
            if time.monotonic() > deadline:
                raise RankFailure(f"--world-size {world_size}: ranks {sorted(set(range(world_size)) - done)} "
                                  f"did not finish within {deadline_s:.0f} s; the ranks were stopped")
            dead = [r for r, p in enumerate(procs) if r not in done and not p.is_alive()]
            if dead:
                try:  # what a rank sent just before it exited may still be in the pipe
                    while len(done) < world_size:
                        handle(*messages.get(timeout=1.0))
                except queue_module.Empty:
                    pass
                dead = [r for r in dead if r not in done]
                if dead:
                    raise RankFailure(f"rank {dead[0]} of {world_size} died (exit code {procs[dead[0]].exitcode}) "
                                      f"before finishing; the other ranks were stopped")
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())) if len(done) == world_size else 0.0)
            if p.is_alive():
                p.kill()
                p.join(5)
        messages.close()
    return results
