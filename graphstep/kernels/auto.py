"""``kernel="auto"`` (the default): the compiled update where ``torch.compile`` works on the device, else fused.

Why compiled first: torch's fused kernels write the divided grads back whenever they are given a grad scale,
i.e. on every clipped or loss-scaled step (4 more bytes per param; docs/perf-notes.md), and they bake betas,
eps and weight decay into a capture. The compiled kernel reads the grads without writing them and keeps
every hyperparameter live. Its price is a compile on the first step of a process (a C++ compiler on the CPU,
Triton on a GPU), except where its every call runs graphstep's native loop (fp32 Adam on the CPU,
``native_runs_every_call``): that library is compiled once per machine, and nothing is probed.

Whether ``torch.compile`` works is found out at build (``probe_compiled``): without a compiler, or on a
miscompile, "auto" falls back to "fused" with one warning (``choose``), on every data-parallel rank alike
(``agree``); ``kernel="compiled"`` set explicitly is refused at build instead: a miscompile is never trained on.
Parity (docs/design.md §8): "fused" is bitwise equal to ``torch.optim``'s fused Adam/AdamW/SGD; "compiled" is
its own loop, within the drift torch's own for-loop Adam shows against the fused one (tests/test_engine.py).
Set ``kernel="fused"`` where bitwise equality with torch's fused step matters more than speed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..native import update_loops
from . import compiled, inductor_options, reference

logger = logging.getLogger("graphstep")


@dataclass(frozen=True)
class KernelChoice:
    name: str  # "fused" | "compiled" | "reference": the implementation the step runs
    reason: str  # why, in words (for "auto"; "configured" otherwise)
    compile_s: float = 0.0  # seconds the probe compile, or the native loop's, took (0 when none ran in this build)


# Elements a rank's update must cover for "auto" to compile: 2**24 (16.8M). Below it the fused kernel's
# grad write-back (4 of 32 bytes per element and step) costs less over a few thousand steps than a process's
# first compile (inductor's start-up, even with its cache warm), which every notebook, test and short job
# would wait for (the figures: docs/perf-notes.md, "The first step").
COMPILE_MIN_NUMEL = 2**24

# per device and hyperparameter dtype: (works, why not, seconds)
_probed: dict[tuple[str, int, torch.dtype], tuple[bool, str, float]] = {}


def _key(device: torch.device, hyper_dtype: torch.dtype) -> tuple[str, int, torch.dtype]:
    return device.type, -1 if device.index is None else device.index, hyper_dtype


@dataclass(frozen=True)
class StepShape:
    """What the step's compiled Adam call will look like: per param group, the lengths of its views, and the
    call's flags. A probe shaped like it (``probe_compiled(like=...)``) compiles the variant the first step
    then runs (over small stand-in views, ``stand_in_numels``), so that a process with a cold
    compile cache compiles once at build instead of once there and again in the first step."""

    group_numels: tuple[tuple[int, ...], ...]  # per group, the numel of each of its views, in call order
    decoupled: bool = True  # AdamW
    scaled: bool = True  # a grad scale is given (a clip or a loss scale)


def step_shape(segments, adam_groups, *, decoupled: bool, scaled: bool) -> Optional[StepShape]:
    """The ``StepShape`` of a step whose Adam groups (indices ``adam_groups``, in order) update ``segments``
    (``Layout.segments(rank)``: one view per segment of a group); None when no Adam group has any."""
    numels = tuple(tuple(s.numel for s in segments if s.group == group) for group in adam_groups)
    numels = tuple(views for views in numels if views)
    return StepShape(numels, decoupled, scaled) if numels else None


def probe_compiled(device: torch.device, hyper_dtype: torch.dtype = torch.float64,
                   like: Optional[StepShape] = None) -> tuple[bool, str, float]:
    """Whether the compiled Adam, given ``hyper_dtype`` hyperparameter tensors, compiles, runs and agrees
    with the reference on ``device``: (works, why not, seconds). Runs once per device, dtype and process;
    later calls return the first answer, and a passed probe is remembered across processes too
    (``_remembered``). ``like``: probe over views shaped like the step's (the answer is the same; the compile is
    then the step's own).

    It compiles and runs the compiled Adam on a few elements, with the compile options and hyperparameter
    dtype the step will use, before any stage is built (the update stage resolves live and baked
    hyperparameters from the chosen module, so the choice cannot change after build). Its compile time is
    reported (``KernelChoice.compile_s``, and an info line on the ``graphstep`` logger); the layout's own
    variant compiles on the first step (``compiled.compile_seconds()`` counts both)."""
    key = _key(device, hyper_dtype)
    if key not in _probed and _remembered(device, hyper_dtype):
        _probed[key] = (True, "", 0.0)
    if key not in _probed:
        start = time.perf_counter()
        try:
            # Called without ``like`` unless given one: the default probe keeps its two-argument form.
            problem = _compare_with_reference(device, hyper_dtype, *([like] if like else []))
        except Exception as error:  # no compiler, no Triton, an inductor bug: all mean "use fused"
            first_line = (str(error).strip().splitlines() or [""])[0][:200]
            problem = f"{type(error).__name__}: {first_line}"
        _probed[key] = (problem is None, problem or "", time.perf_counter() - start)
        if problem is None:
            _remember(device, hyper_dtype)
    return _probed[key]


def verdict_file() -> Optional[Path]:
    """Where passed probes are remembered across processes: next to inductor's compile cache (whose warm
    entries are what make a later first step cheap), so that clearing that cache forgets them too. None
    where this torch does not say where its cache is: nothing is remembered then."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return None
    return Path(cache_dir()) / "graphstep_kernel_probe.json"


def _machine_key(device: torch.device, hyper_dtype: torch.dtype) -> str:
    """Everything a probe's answer depends on, as one string."""
    try:
        import triton
        toolchain = [f"triton {triton.__version__}"]
    except ImportError:
        toolchain = ["no triton"]
    toolchain += [str(shutil.which(cxx)) for cxx in ("c++", "g++", "clang++")]
    name = device.type
    device_module = getattr(torch, device.type, None)
    if device.type != "cpu" and hasattr(device_module, "get_device_name"):
        name += " " + device_module.get_device_name(device)
    if device.type == "cpu":  # the code inductor generates depends on the vector width (ATEN_CPU_CAPABILITY)
        # What the CPU has (torch's reading, at its start) and what the variable asks inductor for now; not
        # inductor's own choice (pick_vec_isa), which compiles test programs (seconds at every build) and
        # raises where no compiler works, where the probe must fail and "auto" fall back instead.
        told = os.environ.get("ATEN_CPU_CAPABILITY")
        name += f" {torch.backends.cpu.get_cpu_capability()}, ATEN_CPU_CAPABILITY={told}"
    sources = hashlib.sha256()
    for module in (compiled, inductor_options, reference, sys.modules[__name__]):
        sources.update(Path(module.__file__).read_bytes())
    return " | ".join([torch.__version__, sys.version.split()[0], name, str(hyper_dtype), *toolchain,
                       sources.hexdigest()[:16]])


def _read_verdicts(path: Path) -> dict:
    try:
        verdicts = json.loads(path.read_text())
        return verdicts if isinstance(verdicts, dict) else {}
    except (OSError, ValueError):
        return {}


def _remembered(device: torch.device, hyper_dtype: torch.dtype) -> bool:
    """Whether a probe passed under this ``_machine_key`` in an earlier process (``verdict_file``): its torch,
    Python, device, hyperparameter dtype, C++ compilers on the path or Triton's version, vector width, and the
    source of the kernels and of this probe. A process with the same key skips the compile and builds in a
    fraction of a second; with inductor's cache warm its first step loads the compiled variant instead of
    compiling it. A failed probe is never remembered: it runs again in the next process."""
    path = verdict_file()
    return path is not None and _read_verdicts(path).get(_machine_key(device, hyper_dtype)) == "works"


def _remember(device: torch.device, hyper_dtype: torch.dtype) -> None:
    """Best effort: an unwritable cache folder only means the next process probes again."""
    path = verdict_file()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        verdicts = _read_verdicts(path)
        verdicts[_machine_key(device, hyper_dtype)] = "works"
        partial = path.with_name(f"{path.name}.{os.getpid()}")  # then one atomic rename: ranks may race
        partial.write_text(json.dumps(verdicts, indent=1))
        os.replace(partial, path)
    except OSError:
        pass


def _compare_with_reference(device: torch.device, hyper_dtype: torch.dtype, like: Optional[StepShape] = None):
    """None when the compiled Adam matches the reference over a few elements, else why not: over two views
    of one group (one with rows and a tail, one with a tail only), or over stand-ins for ``like``'s views."""
    if like is None:
        like = StepShape(((3 * compiled._ROW + 5, 7),))
    else:
        numels = stand_in_numels([n for views in like.group_numels for n in views])
        cut = iter(numels)
        like = StepShape(tuple(tuple(next(cut) for _ in views) for views in like.group_numels), like.decoupled,
                         like.scaled)
    runs = []
    for kernels in (compiled, reference):
        generator = torch.Generator().manual_seed(0)  # the same numbers for both kernels
        groups = []
        for index, numels in enumerate(like.group_numels):
            tensors = [[torch.randn(n, generator=generator).to(device) for n in numels] for _ in range(4)]
            params, grads, exp_avgs, exp_avg_sqs = tensors
            values = dict(lr=1e-2 * (index + 1), beta1=0.9, beta2=0.95, weight_decay=0.1 * (index + 1), eps=1e-8)
            hyper = {name: torch.tensor(value, dtype=hyper_dtype, device=device) for name, value in values.items()}
            groups.append((params, grads, exp_avgs, [v.abs() for v in exp_avg_sqs], hyper))
        scalars = dict(step=torch.ones((), device=device), decoupled=like.decoupled,
                       grad_scale=torch.full((), 2.0, device=device) if like.scaled else None,
                       found_inf=torch.zeros((), device=device))
        with update_loops.off():  # torch.compile is what is probed, never the native loop
            if len(groups) == 1:  # ``adam`` (one group's call: the same compiled variant as ``adam_groups``'s)
                kernels.adam(*groups[0][:4], **groups[0][4], **scalars)
            else:
                kernels.adam_groups(groups, **scalars)
        runs.append(torch.cat([t for params, _, exp_avgs, exp_avg_sqs, _ in groups
                               for t in params + exp_avgs + exp_avg_sqs]))
    if not torch.allclose(runs[0], runs[1], rtol=1e-5, atol=1e-7):
        return "its result differs from the reference kernel's"
    return None


def stand_in_numels(numels: list[int]) -> list[int]:
    """Small view lengths that compile to the same variant as views of ``numels`` elements: each cut the same
    way (``compiled._cuts``: a body of rows and a tail, each static where it is a single row), with every
    dynamic row count at least 2 and equal exactly where the originals' are (dynamo gives equal sizes one
    symbol). A probe over views of these lengths compiles the very graph a step over the originals then runs."""
    sizes = sorted({rows for n in numels for rows in _dynamic_rows(n)})
    if len(sizes) + 2 > compiled._ROW:  # a tail's stand-in must stay shorter than a row: no stand-ins then
        return list(numels)
    small = {rows: 2 + index for index, rows in enumerate(sizes)}  # distinct, >= 2, in the same order
    out = []
    for n in numels:
        body, tail = divmod(n, compiled._ROW)
        out.append(compiled._ROW * (small.get(body, body)) + small.get(tail, tail))
    return out


def _dynamic_rows(n: int) -> list[int]:
    """The row counts of the ``compiled._cuts`` parts of ``n`` that ``compiled._as_rows`` marks dynamic (more than
    one row)."""
    return [(hi - lo) // width for lo, hi, width in compiled._cuts(n) if (hi - lo) // width > 1]


def runs_configured_kernel(family) -> bool:
    """Whether a family's update runs ``OptimizerConfig.kernel``: it brings no kernels module of its own, or its
    own has a compiled twin (AdEMAMix's) that "compiled" swaps in."""
    return family.kernels is None or hasattr(family.kernels, "compiled_twin")


def native_runs_every_call(device: torch.device, families, adam_groups: list[int], tensors: list, *,
                           full_width: bool) -> bool:
    """Whether every call of the compiled kernel in a step would run the native loop
    (``compiled.native_adam_covers``; its library is built or loaded here if need be): on the CPU, Adam's groups
    (``adam_groups``) alone on the configured kernel (no other family, no compiled twin), over main params,
    grads and moments (``tensors``) all fp32 and kept at full width (``full_width``: none stored below fp32,
    none offloaded)."""
    on_configured = [g for g, family in enumerate(families) if runs_configured_kernel(family)]
    return (device.type == "cpu" and full_width and on_configured == adam_groups and bool(tensors)
            and all(t.dtype == torch.float32 for t in tensors) and update_loops.library() is not None)


def choose(configured: str, device: torch.device, *, capture: str, warmup_steps: int,
           needs_kernel: bool = True, hyper_dtype: torch.dtype = torch.float64,
           numel: Optional[int] = None, like: Optional[StepShape] = None, native: bool = False) -> KernelChoice:
    """The implementation to run for ``OptimizerConfig.kernel=configured`` on ``device``, whose step keeps its
    hyperparameters in ``hyper_dtype`` tensors (graphstep/state/hyperparams.py) and updates ``numel``
    elements on this rank (None: not known, as if large). ``like``: the step's compiled call, when known
    (``StepShape``): a probe that runs compiles that call's variant, and the first step reuses it.
    ``native``: every compiled call of the step runs the native loop (``compiled.native_adam_covers``), which
    is built and loaded already; nothing is left for ``torch.compile`` to do, so nothing is probed.

    "auto" picks "fused" without probing when no param group runs a configurable kernel (Lion, Muon bring
    their own), when this rank updates fewer than ``COMPILE_MIN_NUMEL`` elements, and when a capture could start
    before any eager step (``capture_warmup_steps=0``: the compile must run eagerly first)."""
    if configured == "compiled" and needs_kernel and not native:  # a miscompile refused at build, not trained on
        works, why_not, _ = probe_compiled(device, hyper_dtype, *([like] if like else []))
        if not works:
            raise _compiled_refused(f"on {device} ({why_not})")
    if configured != "auto":
        return KernelChoice(configured, "configured", update_loops.unreported_compile_seconds() if native else 0.0)
    if not needs_kernel:
        return KernelChoice("fused", "no param group runs the configurable update kernel")
    if numel is not None and numel < COMPILE_MIN_NUMEL:
        return KernelChoice("fused", f"{numel:,} elements to update, fewer than {COMPILE_MIN_NUMEL:,}: a compile "
                                     "would not pay for itself")
    if capture != "eager" and warmup_steps < 1:
        return KernelChoice("fused", "capture_warmup_steps=0: the compiled kernel must compile in an eager step "
                                     "before a capture")
    if native:
        seconds = update_loops.unreported_compile_seconds()
        if seconds:
            logger.info("graphstep: kernel='auto' runs 'compiled' as graphstep's native loop on %s (its library "
                        "compiled in %.1f s, once per machine)", device, seconds)
        return KernelChoice("compiled", f"its update runs as graphstep's native loop on {device} "
                                        f"({update_loops.status()})", seconds)
    fresh = _key(device, hyper_dtype) not in _probed
    works, why_not, seconds = probe_compiled(device, hyper_dtype, *([like] if like else []))
    if works:
        if fresh:
            logger.info("graphstep: kernel='auto' runs 'compiled' (torch.compile works on %s; probe compile "
                        "%.1f s, 0 when an earlier process on this machine probed it; the layout's variant "
                        "compiles on the first step)", device, seconds)
        return KernelChoice("compiled", f"torch.compile works on {device}", seconds if fresh else 0.0)
    if fresh:
        warnings.warn(f"graphstep: kernel='auto' runs 'fused': torch.compile does not work on {device} "
                      f"({why_not}); set kernel='fused' to choose it explicitly", stacklevel=3)
    return KernelChoice("fused", f"torch.compile does not work on {device}: {why_not}")


def _compiled_refused(where: str) -> RuntimeError:
    return RuntimeError(f"kernel='compiled': torch.compile does not work {where}; set kernel='fused', or "
                        "kernel='auto', which falls back to 'fused' by itself")


def agree_compiled(comm, device: torch.device, hyper_dtype: torch.dtype, native: bool = False) -> None:
    """``kernel="compiled"`` with several data-parallel ranks: refused on every rank when the probe failed on any.
    A rank refusing alone would leave the others built and waiting for it in their first collective. One MAX
    all-reduce at build (1.0 = "the probe failed here"), before ``choose`` refuses on the failing rank itself."""
    works = native or probe_compiled(device, hyper_dtype)[0]
    failed = torch.tensor(0.0 if works else 1.0, device=device)
    comm.all_reduce_max(failed, "kernel='compiled' agreement")
    # A host read at build, never in the step.
    if works and failed.item():
        raise _compiled_refused("on another data-parallel rank (see its error)")


def agree(choice: KernelChoice, comm, device: torch.device) -> KernelChoice:
    """The same choice on every data-parallel rank: "fused" everywhere when any rank's probe failed.

    Each rank probes ``torch.compile`` alone, and one without a working compiler would otherwise update its
    shard with the fused kernel while the others run the compiled one: still correct, but the ranks'
    arithmetic would differ, and a sharded run would no longer match a one-process run the way a
    uniform one does. One MAX all-reduce at build (1.0 = "this rank runs fused")."""
    fused_here = torch.tensor(0.0 if choice.name == "compiled" else 1.0, device=device)
    comm.all_reduce_max(fused_here, "kernel='auto' agreement")
    # A host read at build, never in the step: the stages are built from the module chosen here.
    if choice.name == "compiled" and fused_here.item():
        warnings.warn("graphstep: kernel='auto' runs 'fused': torch.compile does not work on another "
                      "data-parallel rank, and every rank must run the same kernel", stacklevel=4)
        return KernelChoice("fused", "torch.compile does not work on another data-parallel rank", choice.compile_s)
    return choice
