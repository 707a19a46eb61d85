"""perf/harness.py's report: the derived columns (GB/s, % of bandwidth, the floor), the done-when
checks, and the markdown table. Rows are the dicts harness workers return."""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path
from typing import Optional

import torch

from graphstep.app.bench_core import GRAPHSTEP_BYTES, STREAM_BYTES, TORCH_AMP_BYTES

PIPELINE_BYTES = {"stream": STREAM_BYTES, "graphstep-eager": GRAPHSTEP_BYTES,
                  "graphstep-captured": GRAPHSTEP_BYTES, "graphstep-compiled": GRAPHSTEP_BYTES,
                  "torch-foreach": TORCH_AMP_BYTES,
                  "torch-fused": TORCH_AMP_BYTES, "torch-compiled": TORCH_AMP_BYTES}
LABELS = {"stream": "memory stream x.mul_(1.0001)",
          "graphstep-eager": "graphstep full step, eager",
          "graphstep-captured": "graphstep full step, captured",
          "graphstep-compiled": "graphstep full step, kernel='compiled', captured",
          "torch-foreach": "torch GradScaler + clip + AdamW(foreach)",
          "torch-fused": "torch GradScaler + clip + AdamW(fused)",
          "torch-compiled": "torch GradScaler + compile(clip + AdamW(foreach))"}
BASE_ROW = "graphstep-captured"  # the ratio column's denominator, per shape


def add_derived(rows: list[dict], bandwidth_gbps: float) -> None:
    """GB/s, % of stream bandwidth, the floor, and the ratio to graphstep captured on the same shape."""
    base = {r["shape"]: r for r in rows if r["pipeline"] == BASE_ROW and "median_ms" in r}
    for r in rows:
        if "median_ms" not in r:
            continue
        moved = PIPELINE_BYTES[r["pipeline"]] * r["numel"]
        r["bytes_per_param"] = PIPELINE_BYTES[r["pipeline"]]
        r["gbps"] = moved / (r["median_ms"] * 1e-3) / 1e9
        r["bw_fraction"] = r["gbps"] / bandwidth_gbps
        r["floor_ms"] = moved / (bandwidth_gbps * 1e9) * 1e3
        r["vs_floor"] = r["median_ms"] / r["floor_ms"]
        if r["shape"] in base:
            r["vs_graphstep_captured"] = r["median_ms"] / base[r["shape"]]["median_ms"]


def find(rows, shape, pipeline) -> Optional[dict]:
    return next((r for r in rows if r["shape"] == shape and r["pipeline"] == pipeline and "median_ms" in r), None)


def done_when_checks(rows: list[dict], plan: dict) -> list[dict]:
    """The three acceptance checks, with the numbers they were decided on."""
    checks = []
    counts = sorted(int(s.split("-")[1]) for s in plan if s.startswith("tensors-"))
    lo, hi = find(rows, f"tensors-{counts[0]}", BASE_ROW), find(rows, f"tensors-{counts[-1]}", BASE_ROW)
    if lo and hi and lo["ops_per_step"] and hi["ops_per_step"]:
        spread = abs(hi["ops_per_step"] - lo["ops_per_step"]) / min(lo["ops_per_step"], hi["ops_per_step"])
        ok = spread <= 0.10
        text = (f"{lo['ops_per_step']} ops at {counts[0]} tensors vs {hi['ops_per_step']} at {counts[-1]} "
                f"(same ~{lo['numel'] / 1e6:.1f}M params): {spread:.0%} apart (<= 10%)")
    else:
        ok, text = False, "captured rows missing"
    checks.append({"check": "captured ops/step independent of tensor count", "pass": ok, "detail": text})
    gs_row, fused = find(rows, "many-small", BASE_ROW), find(rows, "many-small", "torch-fused")
    if gs_row and fused:
        speedup = fused["median_ms"] / gs_row["median_ms"]
        ok, text = speedup >= 1.3, (f"torch fused pipeline {fused['median_ms']:.1f} ms / graphstep captured "
                                    f"{gs_row['median_ms']:.1f} ms = {speedup:.2f}x (>= 1.3x)")
    else:
        ok, text = False, "rows missing"
    checks.append({"check": "many-small: graphstep >= 1.3x faster than torch fused", "pass": ok, "detail": text})
    flat = find(rows, "flat", BASE_ROW)
    if flat:
        ok = flat["vs_floor"] <= 1.3
        text = (f"graphstep captured {flat['median_ms']:.1f} ms vs floor {flat['floor_ms']:.1f} ms "
                f"({GRAPHSTEP_BYTES} B x {flat['numel'] / 1e6:.1f}M / measured bandwidth) = {flat['vs_floor']:.2f}x "
                f"(<= 1.3x)")
    else:
        ok, text = False, "row missing"
    checks.append({"check": "flat: graphstep within 1.3x of the bandwidth floor", "pass": ok, "detail": text})
    return checks


def machine_info(bandwidth: list[dict]) -> dict:
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    info = {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu,
            "cores": os.cpu_count(), "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    info["stream_gbps"] = [b.get("gbps") for b in bandwidth]
    return info


def _f(value, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown(rows, checks, distributed, meta, args) -> str:
    bw = meta["bandwidth_gbps"]
    lines = [f"# graphstep perf harness ({'quick' if args.quick else 'full'})", "",
             f"{meta['machine']['cpu']}, {meta['machine']['cores']} cores, {meta['machine']['threads']} torch "
             f"threads, torch {meta['machine']['torch']}, device {rows[0].get('device', '?') if rows else '?'}; "
             f"in-place stream bandwidth {bw:.1f} GB/s (best of {len(meta['bandwidth'])} measurements this run); "
             f"{args.steps} timed steps after {args.warmup} warm-ups per run; each row's fastest of {args.repeat} "
             f"runs (round-robin, one process each); 1-min load average before a row: {meta['load'][0]:.1f}–"
             f"{meta['load'][1]:.1f} on {meta['machine']['cores']} cores (shared machine).", "",
             "| shape | params / tensors | pipeline | ms/step | p10 | p90 | × graphstep captured | B/param moved "
             "| GB/s | % BW | × floor | ops/step | optimizer B/param |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["shape"] not in ("gpt2", "many-small", "flat"):
            continue
        lines.append(_row_line(r))
    lines += ["", "Sweeps (the plots):", "",
              "| shape | params / tensors | pipeline | ms/step | p10 | p90 | × graphstep captured | B/param moved "
              "| GB/s | % BW | × floor | ops/step | optimizer B/param |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [_row_line(r) for r in rows if r["shape"] not in ("gpt2", "many-small", "flat")]
    notes = [f"- {r['shape']} / {r['pipeline']}: {r['notes']}" for r in rows if r.get("notes")]
    lines += ["", "Byte model per param: graphstep 32 B (AdamW 28 + norm read 4; unscale and clip folded into the "
              "update); torch pipelines 48 B (unscale_ r+w 8, clip norm r 4, clip multiply r+w 8, AdamW 28); "
              "docs/design.md §6. × floor = ms / (bytes moved / stream bandwidth). Ops/step: aten ops under a "
              "TorchDispatchMode for one step (captured: the replayed ops).", "", "Notes:", *notes, "",
              "## Done-when checks", ""]
    lines += [f"- **{'PASS' if c['pass'] else 'FAIL'}** {c['check']}: {c['detail']}" for c in checks]
    if distributed is not None:
        lines += ["", "## Distributed (perf/bench_distributed.py)", ""]
        if distributed.get("error"):
            lines.append(f"failed: {distributed['error']}")
        if distributed.get("rows"):
            cols = distributed["columns"]
            lines += [distributed["title"], "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(r.get(c, "") for c in cols) + " |" for r in distributed["rows"]]
    if meta.get("plots"):
        lines += ["", "Plots: " + ", ".join(meta["plots"])]
    return "\n".join(lines) + "\n"


def _row_line(r: dict) -> str:
    size = f"{r.get('numel', 0) / 1e6:.1f}M / {r.get('tensors', '?')}" if "numel" in r else "—"
    if "error" in r:
        return f"| {r['shape']} | {size} | {LABELS[r['pipeline']]} | failed: {r['error']} | | | | | | | | | |"
    return (f"| {r['shape']} | {size} | {LABELS[r['pipeline']]} | {r['median_ms']:.2f} | {r['p10_ms']:.2f} | "
            f"{r['p90_ms']:.2f} | {_f(r.get('vs_graphstep_captured'), '.2f')} | {r['bytes_per_param']} | "
            f"{r['gbps']:.1f} | {r['bw_fraction']:.0%} | {r['vs_floor']:.2f} | {_f(r['ops_per_step'], 'd')} | "
            f"{r['opt_bytes_per_param']:.2f} |")


