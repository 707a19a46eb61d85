"""Lightning and graphstep: ``Trainer(callbacks=[GraphstepAccumulation(), GraphstepSkippedSteps()])``.

Lightning cannot tell graphstep which backward is an earlier micro-batch of ``accumulate_grad_batches``, so
the folded norm would fold in every backward; ``GraphstepAccumulation`` runs those backwards under
``opt.no_sync()``, as a hand-written loop does. ``GraphstepSkippedSteps`` logs ``StepResult.skipped_steps``,
which Lightning never shows. This module imports ``lightning``; nothing in graphstep imports it.
"""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info


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


def _skipped_steps(trainer) -> Optional[torch.Tensor]:
    """The skipped steps of the module's graphstep optimizers, added up on the device; None without one."""
    counters = [opt.result.skipped_steps for opt in _graphstep_optimizers(trainer)]
    return torch.stack(counters).sum() if counters else None


class GraphstepSkippedSteps(pl.Callback):
    """How many steps graphstep skipped (non-finite grads, a norm over ``grad_norm_skip_threshold``; under
    "16-mixed" the steps the GradScaler found inf), as Megatron's logs count skipped iterations: logged as
    ``graphstep/skipped_steps`` after every training batch, with the module's metrics, and said once when
    ``fit`` ends, when ``skipped_steps`` holds it. Several graphstep optimizers: their counts added up.

    No host sync per step: the engine counts on the device, the log hands Lightning that device tensor
    (Lightning reads its logged values when it writes them, every ``log_every_n_steps``), and the end reads
    it once."""

    def __init__(self):
        self.skipped_steps: Optional[int] = None  # set when fit ends

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        skipped = _skipped_steps(trainer)
        if skipped is not None and trainer.logger is not None:
            # float: Lightning reduces what it logs and converts an integer tensor with a warning
            pl_module.log("graphstep/skipped_steps", skipped.float(), on_step=True, on_epoch=False, batch_size=1)

    def on_train_end(self, trainer, pl_module) -> None:
        skipped = _skipped_steps(trainer)
        if skipped is None:
            return
        self.skipped_steps = int(skipped.item())  # host sync, once, after training
        rank_zero_info(f"graphstep: {self.skipped_steps} of {trainer.global_step} optimizer steps skipped "
                       "(non-finite grads or a norm over grad_norm_skip_threshold: params and state unchanged)")
