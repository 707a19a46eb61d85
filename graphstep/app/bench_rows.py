"""``graphstep bench``'s rows: one result per pipeline, the ratio columns and the markdown table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .bench_stats import ratio_interval, summarize


@dataclass
class Row:
    key: str
    label: str
    kind: str  # "stream" | "read" | "update" | "full" | "scaled" | "backward" | "train": what the ratio column
    # compares against ("train": the backward stand-in and the step, timed together)
    bytes_per_elem: int
    median_ms: float = math.nan
    p10_ms: float = math.nan
    p90_ms: float = math.nan
    gbps: float = math.nan
    vs_graphstep: float = math.nan
    vs_floor: float = math.nan
    error: Optional[str] = None
    times_ms: list = field(default_factory=list)
    skipped_steps: Optional[int] = None  # graphstep's rows: steps its optimizer skipped since its build

    def fill(self, times: list[float], numel: int) -> "Row":
        """Set the timing columns from ``times`` (ms per step) over ``numel`` params."""
        self.times_ms = times
        stats = summarize(times)
        self.median_ms, self.p10_ms, self.p90_ms = stats["median_ms"], stats["p10_ms"], stats["p90_ms"]
        self.gbps = self.bytes_per_elem * numel / (self.median_ms * 1e-3) / 1e9
        return self


# The row each kind's "× graphstep" column divides by: for the full steps (with and without a loss scale),
# graphstep's default config (the folded norm); without clipping, its unfolded step; for the read rows, the
# read-only floor; for the backward and backward + step rows, those without the folded norm.
ENGINE_ROW = {"update": "graphstep-update", "full": "graphstep-full-folded", "scaled": "graphstep-scaled-folded",
              "read": "read-floor", "backward": "backward", "train": "backward-step"}
# Kinds that are not an optimizer step: no "× fused floor" column.
NOT_A_STEP = ("stream", "read", "backward", "train")


# The ratios the README's goals are stated in: (numerator row, denominator row, what the ratio is, the goal).
KEY_RATIOS = (
    ("graphstep-scaled-folded", "fused-floor", "default step with loss scale / `_fused_adamw_` floor",
     "<= 1.15; folded <= 1.05"),
    ("graphstep-full-folded", "fused-floor", "default step (clip, no loss scale) / floor", "—"),
    ("graphstep-scaled-folded-copied", "fused-floor", "default step with loss scale, no backward / floor", "<= 1.3"),
    ("graphstep-scaled", "fused-floor", "unfolded step with loss scale / floor", "—"),
    ("backward-step-folded", "backward-step", "backward + default step / backward + unfolded step", "< 1"),
    ("torch-amp", "graphstep-scaled-folded", "torch AMP step / default step", ">= 2"),
    ("adamw-fused-clip", "graphstep-full-folded", "`clip_grad_norm_` + `AdamW(fused)` / default step", ">= 1.5"),
    ("norm-pass", "read-floor", "norm pass / read-only reduction", "—"),
)


def key_ratios(rows: list[Row]) -> list[dict]:
    """Each of ``KEY_RATIOS`` whose two rows ran (in the same interleaved rounds): the ratio of their
    medians and its 95% bootstrap interval over the rounds (``bench_stats.ratio_interval``)."""
    by_key = {r.key: r for r in rows if not r.error and r.times_ms}
    out = []
    for numerator, denominator, label, goal in KEY_RATIOS:
        if numerator in by_key and denominator in by_key:
            ratio, low, high = ratio_interval(by_key[numerator].times_ms, by_key[denominator].times_ms)
            out.append({"numerator": numerator, "denominator": denominator, "label": label, "goal": goal,
                        "ratio": ratio, "low": low, "high": high})
    return out


def add_ratios(rows: list[Row]) -> None:
    """× fused floor (over the one-buffer ``_fused_adamw_``) and × graphstep (over its eager row of the kind;
    a read row: over the read-only reduction)."""
    by_key = {r.key: r for r in rows if not r.error}
    floor = by_key.get("fused-floor")
    for r in rows:
        if r.kind == "stream" or r.error:
            continue
        if floor is not None and r.kind not in NOT_A_STEP:
            r.vs_floor = r.median_ms / floor.median_ms
        engine = by_key.get(ENGINE_ROW.get(r.kind, ""))
        if engine is not None:
            r.vs_graphstep = r.median_ms / engine.median_ms


def _skipped_line(rows: Sequence[Row], meta: dict) -> list[str]:
    """What graphstep's rows skipped (a skipped step times no update): one line, or none without such rows."""
    counted = [r for r in rows if r.skipped_steps is not None and not r.error]
    if not counted:
        return []
    skipping = [r for r in counted if r.skipped_steps]
    if not skipping:
        return ["", "skipped steps: none in graphstep's rows."]
    shared = "; rows timing one configuration share its optimizer and its count" if meta.get("interleave") else ""
    return ["", f"skipped steps (non-finite grads; since the row's optimizer was built, warm-up included{shared}): "
            + ", ".join(f"{r.key} {r.skipped_steps}" for r in skipping)
            + ". A skipped step updates nothing: its time is not an update's."]


def _fmt(value: float, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown(rows: list[Row], meta: dict, paired: Sequence[dict] = ()) -> str:
    """The results table with a one-line header saying what was run where; then ``paired`` (``key_ratios``
    of an interleaved run), when given, as a table of the key ratios with their intervals."""
    how = (", every row timed in the same round-robin rounds." if meta.get("interleave")
           else f", fastest of {meta['repeat']} runs per row." if meta["repeat"] > 1 else ".")
    lines = [
        f"{meta['shapes']}: {meta['numel'] / 1e6:.1f}M fp32 params in {meta['tensors']} tensors, "
        f"{meta['device']}, {meta['threads']} threads, torch {meta['torch']}; "
        f"{meta['steps']} timed steps after {meta['warmup']} warm-ups" + how,
        "",
        "| step | ms/step (median) | p10 | p90 | × graphstep | × fused floor | bytes/param | GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.label} | failed: {r.error} | | | | | | |")
            continue
        lines.append(f"| {r.label} | {r.median_ms:.1f} | {r.p10_ms:.1f} | {r.p90_ms:.1f} | "
                     f"{_fmt(r.vs_graphstep, '.2f')} | {_fmt(r.vs_floor, '.2f')} | {r.bytes_per_elem} | "
                     f"{r.gbps:.1f} |")
    lines += ["", "× graphstep: time over graphstep's eager row of the same kind (full step, with or without "
              "loss scale: the default config, folded; no clip: unfolded, default kernel; for the read rows, "
              "over the read-only reduction; for the backward and backward + step rows, over those unfolded); "
              "× fused floor: over the one-buffer `_fused_adamw_`. GB/s: bytes/param × params / median time "
              "(4 = one read of the grads; 28 = Adam's read p,g,m,v + write p,m,v; 32 = plus the norm's grad "
              "read; 16 = the backward stand-in's zero and accumulate; docs/design.md §6)."]
    lines += _skipped_line(rows, meta)
    if paired:
        lines += ["", "| ratio (of medians) | this run | 95% interval | goal |", "|---|---:|---:|---|"]
        lines += [f"| {r['label']} | {r['ratio']:.2f} | {r['low']:.2f}–{r['high']:.2f} | {r['goal']} |"
                  for r in paired]
        lines += ["", "95% interval: bootstrap over the rounds (each resample takes both rows' times of the same "
                  "rounds); it says how far one run's ratio can be trusted on this machine."]
    return "\n".join(lines)
