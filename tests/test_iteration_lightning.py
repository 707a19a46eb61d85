"""graphstep.Iteration under Lightning's Trainer: the recipe of the docs (manual optimization, ``training_step``
calling the iteration, the scheduler stepped there, ``validation_step`` calling ``iteration.evaluate``), trained
to the same bits as the user's own loop with opt.step() outside Lightning (fp16 loss scaling, clipping, an lr
schedule, 4 micro-batches per step), its validation losses those of a plain forward."""

import warnings

import pytest
import torch
from _iteration_setup import FP16, GPT_CONFIG, bits, loss_fn, micro_batches, optimizer, user_loop

from graphstep.app import models
from graphstep.iteration import Iteration

L = pytest.importorskip("lightning", reason="needs lightning (the optional lightning extra)")

STEPS = 6


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))


def gpt():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16=True casts the fp32 model: warned, and meant here
        model = models.GPT(GPT_CONFIG, seed=0)
        return model, optimizer(model, capture="graph", **FP16)


class IterationModule(L.LightningModule):
    """The recipe: Lightning runs the loop, the iteration runs forward, backward and step."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False  # the iteration runs the backward and the step itself
        self.gpt, self.opt = gpt()
        self.iteration = Iteration(self.gpt, self.opt, loss_fn, capture="graph")
        self.losses, self.validation = [], []

    def configure_optimizers(self):
        return {"optimizer": self.opt, "lr_scheduler": schedule(self.opt)}

    def training_step(self, batch, batch_idx):
        result = self.iteration(batch)  # batch: the step's list of micro-batches
        self.lr_schedulers().step()
        self.losses.append(result.loss.clone())

    def validation_step(self, batch, batch_idx):  # Lightning: model.eval(), under torch.inference_mode()
        self.validation.append(self.iteration.evaluate(batch).clone())


def test_an_iteration_under_lightning_trains_as_the_users_own_loop():
    data = [micro_batches(step) for step in range(STEPS)]
    held_out = [micro_batches(100 + step, k=1)[0] for step in range(2)]
    module = IterationModule()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, max_epochs=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None),
                    torch.utils.data.DataLoader(held_out, batch_size=None))
    assert module.iteration.captured and len(module.losses) == STEPS
    assert trainer.global_step == 0  # Lightning counts the steps its optimizer wrapper takes: none here
    validated = [e for e in module.iteration._graphs.values() if e.kind == "evaluate"]
    assert len(validated) == 1 and validated[0].graph.num_replays >= 1  # sanity check: eager, capture; end: replay

    model, opt = gpt()
    run, sched, losses = user_loop(model, opt), schedule(opt), []

    def validate():
        model.eval()
        with torch.no_grad():
            out = [loss_fn(model, batch) for batch in held_out]
        model.train()
        return out

    validation = validate()  # Lightning's sanity check, before training
    for mbs in data:
        losses.append(run(mbs)[0])
        sched.step()
    validation += validate()
    assert len(module.validation) == 4 and all(torch.equal(bits(a), bits(b))
                                               for a, b in zip(module.validation, validation))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(module.losses, losses))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(module.gpt.parameters(), model.parameters()))
