"""Build and first step, each in a fresh process: what a user waits for before training starts (perf/bench_peers.py).

Each row (a ``peer_pipelines.BUILDERS`` key) runs twice in its own interpreter over GPT-2 small's shapes: first
with an empty inductor cache (a fresh ``TORCHINDUCTOR_CACHE_DIR``: every compile from scratch, and graphstep's
probe of ``torch.compile`` too), then again with the cache the first process left (a later run on the same
machine). Timed in the worker: the build (the optimizer's constructor; for graphstep ``get_optimizer``, which
allocates the flat buffers, copies the params in and chooses the kernel; for the torch.compile rows the
``torch.compile`` wrapper, which compiles nothing yet) and the first step (where the compiled rows compile).
The model's params and the grad sources are made before the clock starts; imports are timed apart.
graphstep's rows also report the seconds its kernel choice's probe compiled (``KernelChoice.compile_s``) and
the process's compiled-kernel seconds (``graphstep.kernels.compiled.compile_seconds()``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve()


def worker(row: str, shapes_name: str) -> dict:
    """One row's build and first step in this process (its inductor cache is whatever the caller set)."""
    warnings.filterwarnings("ignore", message=r"graphstep: step\(\) ran before any backward")  # grads copied in
    t0 = time.perf_counter()
    import torch
    sys.path.insert(0, str(HERE.parent))
    import peer_pipelines as peers
    from graphstep.app import bench_core as core
    from graphstep.app import bench_shapes
    import_s = time.perf_counter() - t0
    inputs = core.Inputs(bench_shapes.SETS[shapes_name](), torch.device("cpu"))
    grads = peers.SharedGrads(inputs)
    pipeline, build_s, first_s = peers.start(row, inputs, grads)
    result = {"row": row, "import_s": import_s, "build_s": build_s, "first_step_s": first_s, "notes": pipeline.notes}
    if row == "graphstep":
        from graphstep.kernels import compiled
        choice = pipeline.optimizer.kernel_choice
        result.update(kernel=choice.name, probe_compile_s=choice.compile_s, compile_s=compiled.compile_seconds())
    return result


def run_row(row: str, shapes_name: str, cache_dir: str, timeout_s: float) -> dict:
    """``worker`` in a fresh interpreter with ``cache_dir`` as its inductor cache; an error becomes the row's."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    cmd = [sys.executable, str(HERE), row, shapes_name]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"row": row, "error": f"did not finish within {timeout_s:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"row": row, "error": f"exit {proc.returncode}: {tail[0][:200]}"}
    return json.loads(lines[-1])


BACKGROUND_LIMIT_S = 300.0


def wait_for_left_compiles(cache_dir: str, limit_s: float, poll_s: float = 0.1) -> float:
    """Wait until no compile a process left running in ``cache_dir`` is still writing its library (graphstep's
    native checks are compiled in the background and finished by the compiler after the process exits:
    graphstep/native/compile_cache.py), at most ``limit_s``; the seconds waited. A warm row then times the
    cache the cold one filled, not a compiler still running on one of the cores."""
    folder = Path(cache_dir) / "graphstep_native"
    start = time.perf_counter()
    while list(folder.glob("*.partial")) and time.perf_counter() - start < limit_s:
        time.sleep(poll_s)
    return time.perf_counter() - start


def startup_rows(rows: list[str], shapes_name: str, timeout_s: float) -> list[dict]:
    """Per row, a cold process (fresh inductor cache) then a warm one (the cache the cold one filled, once the
    compiles the cold one left running have finished: ``wait_for_left_compiles``)."""
    results = []
    for row in rows:
        with tempfile.TemporaryDirectory(prefix="inductor-cold-") as cache_dir:
            for cache in ("cold", "warm"):
                waited = wait_for_left_compiles(cache_dir, BACKGROUND_LIMIT_S) if cache == "warm" else 0.0
                load = os.getloadavg()[0]
                print(f"startup: {row}, {cache} inductor cache (load {load:.1f}) ...", end="", file=sys.stderr,
                      flush=True)
                result = {**run_row(row, shapes_name, cache_dir, timeout_s), "cache": cache, "load_before": load,
                          "waited_for_compiles_s": waited}
                print(f" {result.get('build_s', float('nan')):.1f} s + {result.get('first_step_s', float('nan')):.1f}"
                      f" s {result.get('error', '')}", file=sys.stderr)
                results.append(result)
    return results


def markdown(results: list[dict], labels: dict, shapes_note: str) -> str:
    lines = [f"Build and first step, each in a fresh process ({shapes_note}); cold: an empty inductor cache, "
             "warm: the cache the cold process left.", "",
             "| row | inductor cache | build s | first step s | build + first step s | import s | notes |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in results:
        label = labels.get(r["row"], r["row"])
        if "error" in r:
            lines.append(f"| {label} | {r['cache']} | failed: {r['error']} | | | | |")
            continue
        notes = r.get("notes", "")
        if "kernel" in r:
            notes = (f"kernel={r['kernel']}; probe compile {r['probe_compile_s']:.1f} s, compiled-kernel first "
                     f"calls {r['compile_s']:.1f} s")
        lines.append(f"| {label} | {r['cache']} | {r['build_s']:.2f} | {r['first_step_s']:.2f} | "
                     f"{r['build_s'] + r['first_step_s']:.2f} | {r['import_s']:.1f} | {notes} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(worker(sys.argv[1], sys.argv[2])))
