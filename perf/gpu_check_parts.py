"""The GPU check's parts, in the order they run, with each part's time limit and expected time.

The order puts what settles correctness first, so that if the machine runs out of time the cut falls on
speed: preflight, the CUDA tests, the bitwise eager-vs-captured rows, the negative control, memory,
pinned-thread, NCCL and multi-rank, the optimizer families (the precision-aware optimizer and offload among
them), fp8, FSDP2, the whole iteration captured (bitwise, then its time), then the profile CLI and the speed
rows.

Limits and expectations are for one H100 from a cold inductor cache, all parts in one worker process (its
torch import and CUDA context paid once, in the preflight). The expectations come from the CPU dry run's
part times and the work each part does (``estimate_why``); a part running past its limit is stopped and
recorded as an error, and the run goes on with a fresh worker. The limits add up to at most
``PARTS_BUDGET_S``, so the whole check, install included, ends within ``WHOLE_S``.
"""

from __future__ import annotations

from dataclasses import dataclass

WHOLE_S = 480  # 8 minutes: what the GPU machine's 15 minutes leave after its start and a rerun's margin
INSTALL_LIMIT_S = 30  # pip install --no-deps --no-build-isolation -e . (no network, no build dependencies)
DRIVER_SLACK_S = 10  # the driver's own start, a worker restart's import, writing the report
PARTS_BUDGET_S = WHOLE_S - INSTALL_LIMIT_S - DRIVER_SLACK_S
MULTI_LIMIT_S = 240  # ``--multi`` (>= 2 GPUs): its own run, outside the one-GPU budget
PEERS_LIMIT_S = 300  # ``--peers``: its own run, outside the one-GPU budget (the peers compile for minutes)


@dataclass(frozen=True)
class Part:
    name: str
    module: str
    function: str
    cpu_ok: bool  # runs (on small sizes, over the CPU replay backend) in the --cpu dry run
    limit_s: int
    estimate_s: int  # expected on one H100, cold inductor cache
    estimate_why: str
    checks: tuple


def _bitwise_checks() -> tuple:
    return tuple(f"bitwise-{p}-{k}" for p in ("fp32", "bf16", "fp16") for k in ("fused", "compiled"))


PARTS = (
    Part("preflight", "gpu_check_env", "part_preflight", True, 40, 25,
         "torch import and CUDA context; the compiled Adam and a scalar graph compiled cold (Triton)",
         ("preflight", "preflight-torch-private-api")),
    Part("cuda-tests", "gpu_check_env", "part_cuda_tests", False, 70, 50,
         "pytest start-up and 21 tests over small tensors, a few compiled kernels",
         ("pytest-tests-cuda",)),
    Part("bitwise", "gpu_check_numerics", "part_bitwise", True, 50, 30,
         "12 runs of 30 steps of a 16k-param MLP; one compile per precision (3 Triton kernels)",
         _bitwise_checks() + ("replay-without-host-sync",)),
    Part("recapture", "gpu_check_numerics", "part_recapture", True, 12, 4, "2 runs of 30 steps, fused kernel",
         ("forced-recapture",)),
    Part("negative-control", "gpu_check_numerics", "part_negative_control", True, 8, 3,
         "2 eager runs of 8 steps", ("bitwise-negative-control",)),
    Part("memory", "gpu_check_numerics", "part_memory", True, 12, 4, "10 recapture rounds of a tiny step",
         ("memory-flat-over-10-recaptures",)),
    Part("pinned-thread", "gpu_check_numerics", "part_pinned_thread", False, 12, 5,
         "2 runs of 30 steps while a thread pins and copies 4 MiB buffers", ("capture-with-pinned-memory-thread",)),
    Part("nccl", "gpu_check_numerics", "part_nccl", False, 15, 6, "a world-size-1 NCCL group: init and 4 calls",
         ("nccl-world1-collectives-captured",)),
    Part("multi", "gpu_check_multi", "part_multi", True, 5, 1,
         "one GPU: the skip; >= 2 GPUs: run with --multi (its own limit)",
         ("multi-captured-step-matches-eager", "multi-teardown-after-capture", "multi-dead-peer-bounded")),
    Part("families", "gpu_check_numerics", "part_families", True, 35, 18,
         "Muon, offload and the precision-aware optimizer: 6 runs of 30 steps; Newton-Schulz compiled",
         ("family-muon", "family-offload", "family-precision-aware")),
    Part("offload", "gpu_check_offload", "part_offload", True, 25, 12,
         "4 runs of 30 steps with a host half; pinned buffers; sync debug mode",
         ("offload-eager-vs-captured", "offload-vs-device-only", "offload-overlap", "offload-pinned-and-memory")),
    Part("fp8", "gpu_check_numerics", "part_fp8", True, 20, 8, "2 runs of 30 steps with one fp8 layer",
         ("family-fp8",)),
    Part("fsdp2", "gpu_check_fsdp2", "part_fsdp2", True, 20, 10,
         "a one-rank FSDP2 mesh: init, 2 runs of 12 steps, 2 runs of 12 iterations",
         ("fsdp2-one-rank-captured-vs-eager", "fsdp2-one-rank-iteration-captured-vs-eager")),
    Part("iteration", "gpu_check_iteration", "part_iteration", True, 10, 5,
         "a 4-layer narrow GPT, 4 micro-batches: 2 runs of 12 iterations and 3 evaluations (a third where they "
         "differ), then 10 interleaved rounds of 5 iterations, eager and captured",
         ("iteration-captured-vs-eager-bitwise", "iteration-captured-vs-eager-time")),
    Part("profile-cli", "gpu_check_env", "part_profile_cli", False, 20, 12,
         "graphstep profile: its own interpreter, 5 steps", ("graphstep-profile-capture-graph",)),
    Part("kernels", "gpu_check_speed", "part_kernels", True, 20, 10,
         "3 tensor counts and the planted-kernel control, 5 profiled replays each",
         ("kernels-per-replay-independent-of-tensor-count", "kernels-negative-control")),
    Part("speed", "gpu_check_speed", "part_speed", True, 30, 18,
         "10,000 small tensors vs flat, 50 timed steps; the 64M flat step vs the HBM stream",
         ("captured-10k-tensors-vs-flat", "cpu-time-per-replay", "flat-64M-vs-hbm-floor")),
    Part("fold", "gpu_check_speed", "part_fold", True, 35, 22,
         "7 pipelines at GPT-2 small (124M params), 30 interleaved rounds; the compiled kernel cold",
         ("fold-step-vs-fused-floor", "fold-backward-plus-step", "default-step-vs-torch-amp",
          "default-step-vs-adamw-fused-clip")),
)
# Not in PARTS: it runs only in its own invocation, ``--peers``.
PEERS = Part("peers", "gpu_check_peers", "part_peers", True, PEERS_LIMIT_S, 150,
             "GPT-2 small: graphstep captured, torch.compile'd AdamW with and without the clip (two compiles over "
             "148 tensors, Triton), heavyball where installed, the floor; 30 interleaved rounds",
             ("peers-default-vs-torch-compiled-clip", "peers-default-vs-torch-compiled",
              "peers-default-vs-heavyball-clip", "peers-default-vs-heavyball"))
BY_NAME = {part.name: part for part in (*PARTS, PEERS)}


def budget_problem(parts=PARTS) -> str:
    """Why these parts cannot all finish inside the budget ("" when they can)."""
    total = sum(part.limit_s for part in parts)
    if total > PARTS_BUDGET_S:
        return (f"the parts' time limits add up to {total} s, over the {PARTS_BUDGET_S} s the {WHOLE_S} s check "
                f"leaves them: lower a limit in perf/gpu_check_parts.py")
    late = [p.name for p in parts if p.estimate_s > p.limit_s]
    if late:
        return f"part(s) {', '.join(late)} expected to take longer than their limit"
    return ""
