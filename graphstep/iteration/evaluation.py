"""Evaluation with an iteration: a forward-only graph per input signature, in the training graphs' memory pool.

``iteration.evaluate(batch)`` runs ``eval_fn(model, batch)`` (by default the iteration's ``loss_fn``) under
``torch.no_grad()``: no backward, no grad touched, no optimizer step (schedulers are not told a step ran). It is
captured like training: a graph per signature (the batch's structure, shapes, dtypes and Python values, and the
model's train/eval flags), counted in the same ``max_graphs``, on CUDA in the same memory pool as the training
graphs. Sharing the pool is safe because no graph leaves anything alive in it: the training graphs write into
the optimizer's static buffers, and an evaluation's results are copied into tensors allocated outside the pool,
at the first evaluation of each signature, which therefore always runs eagerly (``StaticOutputs``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .inputs import StaticBatch


class StaticOutputs:
    """What ``eval_fn`` returned, copied into tensors made at the first (eager) run; ``result`` nests them as
    ``eval_fn`` did. A replay writes the same tensors again: the caller clones what it keeps."""

    def __init__(self) -> None:
        self.tensors: Optional[list] = None
        self.result: Any = None

    def store(self, out: Any) -> None:
        leaves, spec = tree_flatten(out)
        if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
            kinds = sorted({type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)}) or ["nothing"]
            raise TypeError("graphstep.Iteration: eval_fn must return a tensor or a nest of tensors (lists, tuples, "
                            f"dicts), got {', '.join(kinds)}: a graph replays tensors only, so return Python values "
                            "as tensors (torch.as_tensor outside the model is a host copy: compute them on device)")
        if self.tensors is None:
            self.tensors = [torch.empty_like(x) for x in leaves]
            self.result = tree_unflatten(self.tensors, spec)
        shapes = [tuple(x.shape) for x in leaves]
        if shapes != [tuple(t.shape) for t in self.tensors]:
            raise RuntimeError(f"graphstep.Iteration: eval_fn returned tensors of shapes {shapes} for an input "
                               f"signature that gave {[tuple(t.shape) for t in self.tensors]} before: an evaluation's "
                               "output shapes must follow from its input shapes")
        for static, x in zip(self.tensors, leaves):
            static.copy_(x)

    def named(self) -> dict:
        """The result tensors by name: static inputs a capture guards (they must not be replaced)."""
        return {f"evaluation output[{i}]": t for i, t in enumerate(self.tensors or ())}


def evaluation_fn(model: torch.nn.Module, eval_fn: Callable[[torch.nn.Module, Any], Any], batch: StaticBatch,
                  outputs: StaticOutputs, forward_range: Callable[[], Any]) -> Callable[[], None]:
    """The function an evaluation graph records: the forward over the static batch, its results stored.
    ``forward_range()``: the profiler range to run the forward in (a no-op while capturing)."""
    (static_batch,) = batch.micro_batches

    def evaluation() -> None:
        with torch.no_grad(), forward_range():
            outputs.store(eval_fn(model, static_batch))

    return evaluation
