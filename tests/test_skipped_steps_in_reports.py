"""The run's count of skipped steps (``StepResult.skipped_steps``, a device counter) where a run reports:
the demo's progress lines and summary, the benchmark's table and JSON, and Lightning's Trainer through
``graphstep.app.lightning.GraphstepSkippedSteps``. Each reads the counter where it already syncs, never
per step."""

import json
import re
import warnings

import pytest
import torch

from graphstep.app import bench, cli, demo
from graphstep.app import bench_core as core


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: the tiny model runs on one thread


def overflowing_fp16(monkeypatch):
    """The demo's fp16 run starting from a loss scale its fp16 grads overflow at: every step is skipped."""
    flags = demo.config_flags
    monkeypatch.setattr(demo, "config_flags", lambda precision, **kw: flags(precision, initial_loss_scale=2.0**60))


def test_the_demo_reports_skipped_steps_in_progress_and_summary(monkeypatch, capsys, tmp_path):
    overflowing_fp16(monkeypatch)
    assert cli.main(["demo", "--steps", "4", "--batch-size", "2", "--precision", "fp16", "--log-every", "2",
                     "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for run in ("eager", "graph"):
        progress = re.findall(rf"^{run} step\s+(\d+)/4 .*?(?:skipped (\d+))?$", out, re.M)
        assert [(int(step), int(skipped or 0)) for step, skipped in progress] == [(1, 1), (2, 2), (4, 4)], out
    assert "skipped steps: eager 4 of 4, graph 4 of 4 (non-finite grads: params, optimizer state and step " \
           "count left unchanged)" in out, out


def test_the_demo_says_nothing_about_skips_when_there_were_none(capsys, tmp_path):
    assert cli.main(["demo", "--steps", "2", "--batch-size", "2", "--capture", "eager", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "skipped steps:" not in out and " skipped " not in out.split("summary")[0]


def test_the_demo_reads_the_engines_counter(monkeypatch):
    """The RunResult's count is the engine's own (StepResult.skipped_steps), not a second count kept beside it."""
    overflowing_fp16(monkeypatch)
    settings = demo.DemoSettings(steps=3, batch_size=2, precision="fp16")
    result = demo.train(settings, "eager")
    assert result.skipped == 3


def test_the_bench_reports_each_graphstep_rows_skipped_steps(tmp_path, capsys, monkeypatch):
    real_inputs = core.Inputs

    def poisoned_inputs(*args, **kwargs):
        inputs = real_inputs(*args, **kwargs)
        inputs.grad_flat[0] = float("inf")  # every step of every row sees a non-finite grad
        return inputs

    monkeypatch.setattr(bench.core, "Inputs", poisoned_inputs)
    out_json = tmp_path / "bench.json"
    assert bench.main(["--quick", "--steps", "2", "--warmup", "1", "--only", "fused-floor,graphstep-full",
                       "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    rows = {row["key"]: row for row in json.loads(out_json.read_text())["rows"]}
    # the build's own warm-up step, then 1 warm-up and 2 timed steps: all skipped
    assert rows["graphstep-full"]["skipped_steps"] == 4 and rows["fused-floor"]["skipped_steps"] is None
    assert "skipped steps (non-finite grads; since the row's optimizer was built, warm-up included): " \
           "graphstep-full 4" in out, out


def test_the_bench_says_when_no_step_was_skipped(capsys):
    assert bench.main(["--quick", "--steps", "1", "--warmup", "0", "--only", "graphstep-full"]) == 0
    assert "skipped steps: none in graphstep's rows" in capsys.readouterr().out


# ---- Lightning -----------------------------------------------------------------------------------------------

INF_STEPS = (2, 4)  # these steps' losses are inf: their grads are non-finite, the engine skips them


def lightning_fit(precision, callbacks, logger=False, steps=6):
    L = pytest.importorskip("lightning", reason="needs lightning (the optional lightning extra)")
    from lightning.pytorch.plugins.precision import MixedPrecision

    import graphstep as gs

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(16, 16)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.net(batch).float(), batch)
            return loss * float("inf") if self.trainer.global_step in INF_STEPS else loss

        def configure_optimizers(self):
            return gs.get_optimizer(gs.OptimizerConfig(lr=1e-2, clip_grad=0.0, capture="graph"), self)

    plugins = {"precision": precision}
    if precision == "16-mixed":  # Lightning's 16-mixed plugin with the CPU as its device (tests/test_lightning.py)
        plugins = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=logger, log_every_n_steps=1, max_steps=steps,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=callbacks, **plugins)
    data = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(steps)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=None))
    return trainer


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_lightning_callback_counts_the_skipped_steps_once_at_the_end(precision):
    pytest.importorskip("lightning", reason="needs lightning (the optional lightning extra)")
    from graphstep.app.lightning import GraphstepSkippedSteps

    callback = GraphstepSkippedSteps()
    lightning_fit(precision, [callback])
    assert callback.skipped_steps == len(INF_STEPS)


def test_lightning_callback_logs_the_count_with_the_modules_metrics(tmp_path):
    L = pytest.importorskip("lightning", reason="needs lightning (the optional lightning extra)")
    import csv

    from graphstep.app.lightning import GraphstepSkippedSteps

    lightning_fit("32-true", [GraphstepSkippedSteps()], logger=L.pytorch.loggers.CSVLogger(tmp_path, name="run"))
    (metrics,) = tmp_path.glob("run/version_*/metrics.csv")
    logged = [float(row["graphstep/skipped_steps"]) for row in csv.DictReader(metrics.open())
              if row.get("graphstep/skipped_steps")]
    # logged after each step (log_every_n_steps=1): the count so far, the inf steps (2 and 4) counted as they come
    assert logged == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
