"""Lightning and graphstep's gradient accumulation: ``Trainer(callbacks=[GraphstepAccumulation()])``.

Lightning's own precision plugins step a graphstep optimizer as they are (the README's "With Lightning").
What they cannot do is tell graphstep which backward is an earlier micro-batch of
``accumulate_grad_batches``: graphstep's folded norm (``fold_grad_norm``) then folds in every backward,
warns once, and folds right before the step instead, one more read of the grads per step. This callback
runs the backward of every micro-batch Lightning does not step after under ``opt.no_sync()``, so the norm
is folded in the last backward only, as in a hand-written loop.

This module imports ``lightning``; nothing in graphstep imports it.
"""

from __future__ import annotations

import lightning.pytorch as pl


def _graphstep_optimizers(trainer):
    from graphstep.engine import GraphstepOptimizer

    return [opt for opt in trainer.optimizers if isinstance(opt, GraphstepOptimizer)]


class GraphstepAccumulation(pl.Callback):
    """Earlier micro-batches' backward under ``opt.no_sync()`` for every graphstep optimizer of the module."""

    def __init__(self):
        self._open = []  # the no_sync contexts entered for the backward running now
        self._accumulating = False  # this batch is an earlier micro-batch: Lightning does not step after it

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # Lightning's rule (its training epoch loop): it steps after every accumulate_grad_batches-th batch
        # of the epoch and after the epoch's last batch.
        done = batch_idx + 1
        self._accumulating = done % trainer.accumulate_grad_batches != 0 and done != trainer.num_training_batches

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if not (pl_module.automatic_optimization and self._accumulating):
            return
        for opt in _graphstep_optimizers(trainer):
            context = opt.no_sync()
            context.__enter__()
            self._open.append(context)

    def on_after_backward(self, trainer, pl_module) -> None:
        self._close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._close()  # a backward that raised leaves no optimizer in no_sync

    def _close(self) -> None:
        while self._open:
            self._open.pop().__exit__(None, None, None)
