"""How perf/gpu_check.py runs its parts: in one worker process, each under its own time limit.

One worker imports torch and initialises CUDA once and runs the parts in order, announcing each part's start
and writing its records when it ends (one JSON line each, to a progress file the driver reads). The driver
stops a part that runs past its limit, records it as an error and starts a fresh worker for the parts after
it; a worker that crashes costs the part it was in. On a GPU the worker also exits after a part that errored,
since a CUDA error can poison the context for every part after it.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_check_parts import BY_NAME

NO_CUDA = "skipped: no CUDA"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER_START_S = 60  # the worker's own start (torch import, CUDA context) before its first part


def _records(part, status: str, detail: str) -> list[dict]:
    return [{"check": c, "status": status, "detail": detail, "numbers": {}, "part": part.name} for c in part.checks]


def worker_main(names: list[str], progress: Path, cpu: bool, multi: bool) -> int:
    """Inside the worker: run ``names`` in order, one progress line at each part's start and end."""
    import torch

    sys.path.insert(0, str(HERE))
    from graphstep.app.bench_core import pick_device

    device = torch.device("cpu") if cpu else pick_device()

    def emit(**event) -> None:
        with progress.open("a") as f:
            f.write(json.dumps(event, default=str) + "\n")

    for name in names:
        part = BY_NAME[name]
        emit(event="start", part=name)
        start = time.perf_counter()
        if cpu and not part.cpu_ok:
            emit(event="done", part=name, results=_records(part, NO_CUDA, ""), wall_s=0.0)
            continue
        try:
            function = getattr(importlib.import_module(part.module), part.function)
            results = function(device, cpu, **({"run_ranks": True} if multi and name == "multi" else {}))
        except Exception as error:  # the whole part broke: every check it owns says so
            results = [{"check": c, "status": "error", "detail": f"{type(error).__name__}: {error}", "numbers": {}}
                       for c in part.checks]
        emit(event="done", part=name, results=results, wall_s=round(time.perf_counter() - start, 1))
        if not cpu and any(r["status"] == "error" for r in results):
            return 3  # a fresh worker for the rest: this CUDA context may be unusable
    return 0


def _complete_lines(path: Path) -> list[str]:
    """The progress file's lines the worker has finished writing (the last one may be half written)."""
    text = path.read_text() if path.exists() else ""
    return text.split("\n")[:-1]


def _tail(path: Path, lines: int = 5) -> list[str]:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text.strip().splitlines()[-lines:]


def run_parts(parts: list, cpu: bool, deadline: float, multi: bool, on_part) -> None:
    """Run ``parts`` (``gpu_check_parts.Part``, each with its limit) in workers until done or ``deadline``
    (time.monotonic); ``on_part(part_record, checks)`` is called once per part, in order."""
    chosen = {part.name: part for part in parts}
    pending = list(chosen)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(HERE),
                                                                     os.environ.get("PYTHONPATH")]))}
    while pending:
        if deadline - time.monotonic() < 5:
            for name in pending:
                on_part({"part": name, "exit_code": None, "status": "not run: time budget spent"},
                        _records(chosen[name], "error", "not run: the time budget was spent"))
            return
        pending = _one_worker(pending, chosen, cpu, deadline, multi, env, on_part)


def _one_worker(pending: list[str], chosen: dict, cpu: bool, deadline: float, multi: bool, env: dict,
                on_part) -> list[str]:
    """Start a worker on ``pending``; return the parts still to run when it ends or is stopped."""
    with tempfile.TemporaryDirectory() as tmp:
        progress, log = Path(tmp) / "progress.jsonl", Path(tmp) / "worker.log"
        cmd = [sys.executable, str(HERE / "gpu_check.py"), "--worker", ",".join(pending), "--progress", str(progress)]
        cmd += (["--cpu"] if cpu else []) + (["--multi"] if multi else [])
        with log.open("w") as out:
            # its own process group: a part stopped at its limit takes its children (pytest, the profile CLI) along
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        current, started, seen, spawned = None, None, 0, time.monotonic()
        pending = list(pending)
        while True:
            lines = _complete_lines(progress)
            for line in lines[seen:]:
                event = json.loads(line)
                if event["event"] == "start":
                    current, started = event["part"], time.monotonic()
                else:
                    part = chosen[event["part"]]
                    results = [{**r, "part": part.name} for r in event["results"]]
                    on_part({"part": part.name, "exit_code": 0, "wall_s": event["wall_s"],
                             "limit_s": part.limit_s, "estimate_s": part.estimate_s}, results)
                    pending.remove(part.name)
                    current = None
            seen = len(lines)
            code = proc.poll()
            now = time.monotonic()
            if code is not None and len(_complete_lines(progress)) == seen:
                break
            limit = chosen[current].limit_s if current else WORKER_START_S
            if now - (started if current else spawned) > limit or now > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                why = "the time budget was spent" if now > deadline else f"did not finish within its {limit} s limit"
                code = "timeout"
                break
            time.sleep(0.1)
        tail = _tail(log)
        if code not in (0, 3, "timeout") and current is None and pending and not seen:
            for name in pending:  # the worker died before its first part (an import): the same for every worker
                on_part({"part": name, "exit_code": code, "output_tail": tail},
                        _records(chosen[name], "error", f"worker exit {code}: {tail[-1] if tail else 'no output'}"))
            return []
        if current is not None or (code not in (0, 3) and pending):
            name = current or pending[0]
            part = chosen[name]
            why = why if code == "timeout" else f"worker exit {code}: {tail[-1] if tail else 'no output'}"
            on_part({"part": name, "exit_code": code, "wall_s": round(time.monotonic() - (started or spawned), 1),
                     "limit_s": part.limit_s, "estimate_s": part.estimate_s, "output_tail": tail},
                    _records(part, "error", why))
            pending.remove(name)
    return pending
