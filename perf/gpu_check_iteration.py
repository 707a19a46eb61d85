"""perf/gpu_check.py's whole-iteration part: graphstep.Iteration captured against the same iteration eager.

Two rows, over a launch-bound model (a narrow GPT with dropout: thousands of small kernels per iteration, each
far shorter than its launch from Python), trained from host batches (pinned memory and the side-stream copy):

- ``iteration-captured-vs-eager-bitwise``: the losses, grad norms and params of a captured run equal the eager
  run's bit for bit, over training, then evaluations (``iteration.evaluate``, the forward-only graphs in the same
  memory pool), then training again. Where they differ, a second eager run says whether the kernels themselves
  are non-deterministic on this machine (eager differs from eager) or the capture is at fault.
- ``iteration-captured-vs-eager-time``: ms per iteration, eager and captured, interleaved rounds; on a GPU the
  captured iteration is one graph launch and must be faster (the claim; the ratio is reported). On the CPU (the
  dry run) the replay backend saves the forward's Python but re-dispatches every op from Python: reported for
  reference only.

Nothing here needs transformer-engine or a torch newer than the check's oldest (2.11).
"""

from __future__ import annotations

import statistics
import warnings

import torch
import torch.nn.functional as F

import graphstep as gs
from capture.devices import is_cuda, synchronize
from graphstep.app import bench_core as core
from graphstep.app import models
from graphstep.iteration import Iteration
from gpu_check_numerics import NO_CUDA, close, record

BITWISE, TIME = "iteration-captured-vs-eager-bitwise", "iteration-captured-vs-eager-time"
# The claim on a launch-bound model: the captured iteration is faster than eager (below 1x).
TIME_GOAL = 1.0
DROPOUT = 0.1


def _config(small: bool) -> models.GPTConfig:
    if small:
        return models.tiny(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    return models.tiny(vocab_size=256, seq_len=32, d_model=64, n_layers=4, n_heads=4, d_ff=128)


def _model(config: models.GPTConfig, device) -> torch.nn.Module:
    model = models.GPT(config, seed=0).to(device)
    for block in model.blocks:  # dropout after every block: random numbers a replay must draw anew
        block.register_forward_hook(lambda module, args, out: F.dropout(out, DROPOUT, module.training))
    return model


class Twin:
    """One model, its optimizer and its iteration, eager or captured; batches made on the host."""

    def __init__(self, mode: str, device, small: bool):
        self.config = _config(small)
        self.k, self.rows = (2, 2) if small else (4, 4)
        self.model = _model(self.config, device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, clip_grad=1.0, kernel="fused", capture=mode,
                                                      capture_warmup_steps=2), self.model)
        self.iteration = Iteration(self.model, opt, models.gpt_loss, capture=mode)
        self.corpus = models.SyntheticCorpus(self.config.vocab_size, seed=0)

    def batches(self, step: int) -> list:
        inputs, targets = self.corpus.batch(step, self.k * self.rows, self.config.seq_len)  # on the host
        return models.micro_batches(inputs, targets, self.k)

    def train(self, steps: range) -> list:
        out = []
        for step in steps:
            result = self.iteration(self.batches(step))
            out.append(torch.stack([result.loss, result.grad_norm]).detach().clone())
        return out

    def evaluate(self, steps: range) -> list:
        self.model.eval()
        out = [self.iteration.evaluate(self.batches(1000 + step)[0]).detach().clone() for step in steps]
        self.model.train()
        return out

    def close(self) -> None:
        self.iteration.close()
        close(self.iteration.optimizer)


def _history(mode: str, device, small: bool, seed: int = 1) -> tuple[list, list]:
    """Training, evaluation, training again; the recorded values and the final params."""
    twin = Twin(mode, device, small)
    torch.manual_seed(seed)  # dropout's draws: the same stream for every run (the CUDA generator included)
    n = 3 if small else 6  # iterations before and after the evaluations
    values = twin.train(range(n)) + twin.evaluate(range(n // 2)) + twin.train(range(n, 2 * n))
    params = [p.detach().clone() for p in twin.model.parameters()]
    backend = twin.iteration.capture_backend
    twin.close()
    return values + params, [backend]


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit pattern (NaN equals NaN, -0.0 differs from 0.0): what a bitwise comparison compares."""
    t = t.detach().reshape(-1)
    return t.view(_INT_OF_SIZE[t.element_size()])


def differing(a: list, b: list) -> list:
    """Indices where two recorded runs differ, bit for bit."""
    return [i for i, (x, y) in enumerate(zip(a, b)) if x.shape != y.shape or not torch.equal(_bits(x), _bits(y))]


def bitwise_verdict(differs: list, eager_differs: list, total: int, backend: str) -> dict:
    """The bitwise row: pass when nothing differs; a failure says whether eager itself is non-deterministic."""
    if not differs:
        return record(BITWISE, "pass", f"{total} recorded values (each iteration's loss and grad norm, each "
                      f"evaluation's loss, every param) bitwise equal, captured ({backend}) vs eager", compared=total)
    cause = ("eager differs from eager too: this machine's kernels are not deterministic, so the capture is not "
             "what differs" if eager_differs else "eager equals eager: the capture changed the result")
    return record(BITWISE, "fail", f"{len(differs)} of {total} values differ (first at {differs[:5]}); {cause}",
                  differs=differs[:20], eager_differs=eager_differs[:20])


def time_verdict(eager_ms: float, captured_ms: float, cuda: bool, detail_extra: str = "") -> dict:
    """The time row: captured / eager ms per iteration, below ``TIME_GOAL`` on a GPU; nothing measured fails."""
    numbers = {"eager_ms": eager_ms, "captured_ms": captured_ms}
    if not (eager_ms > 0 and captured_ms > 0):
        return record(TIME, "fail", f"measured nothing (eager {eager_ms} ms, captured {captured_ms} ms)", **numbers)
    ratio = captured_ms / eager_ms
    detail = (f"captured {captured_ms:.3f} ms / eager {eager_ms:.3f} ms per iteration = {ratio:.2f}x (goal < "
              f"{TIME_GOAL}x){detail_extra}")
    if not cuda:
        return record(TIME, NO_CUDA, "CPU replay for reference (no kernel launches to save): " + detail,
                      ratio=ratio, **numbers)
    return record(TIME, "pass" if ratio < TIME_GOAL else "fail", detail, ratio=ratio, **numbers)


def part_iteration(device, small: bool) -> list[dict]:
    captured, (backend,) = _history("graph", device, small)
    eager, _ = _history("eager", device, small)
    differs = differing(captured, eager)
    eager_differs = differing(eager, _history("eager", device, small)[0]) if differs else []
    rows = [bitwise_verdict(differs, eager_differs, len(captured), backend)]
    core.free_memory(device)
    rows.append(_timing(device, small))
    return rows


def _timing(device, small: bool) -> dict:
    twins = {mode: Twin(mode, device, small) for mode in ("eager", "graph")}
    data = {mode: twin.batches(0) for mode, twin in twins.items()}
    for mode, twin in twins.items():
        for _ in range(4):  # warm-up and capture
            twin.iteration(data[mode])
    rounds, per_round = (3, 2) if small else (10, 5)

    def timed(mode):
        def run():
            for _ in range(per_round):
                twins[mode].iteration(data[mode])
        return run

    times = core.time_interleaved({mode: timed(mode) for mode in twins}, device, 1, rounds)
    synchronize(device)
    ms = {mode: statistics.median(t) / per_round for mode, t in times.items()}
    graphs = twins["graph"].iteration.num_graphs
    model = twins["graph"].config
    for twin in twins.values():
        twin.close()
    extra = (f"; GPT {model.n_layers} layers x d_model {model.d_model}, {twins['graph'].k} micro-batches of "
             f"{twins['graph'].rows} x {model.seq_len} tokens, {graphs} graph, {rounds} rounds of {per_round}")
    return time_verdict(ms["eager"], ms["graph"], is_cuda(device), extra)
