"""The checkpoint view (graphstep/checkpoint/view.py): the parts of an optimizer its checkpoints read and write,
handed over by the engine. The formats themselves are tested in test_checkpoint.py and test_state_dict.py."""

import torch

import graphstep as gs


def _engine(**config):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return model, gs.get_optimizer(gs.OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, **config), model)


def test_the_view_holds_the_build_records_parts_and_the_live_groups():
    _, opt = _engine(fp16=True)
    view, record = opt.checkpoint_view(), opt.build_record
    assert view.domains is record.domains and view.step is record.tensors.step and view.scaler is record.scaler
    assert view.comm is record.comm and view.config is record.config and view.param_groups is opt.param_groups
    assert view.layout is opt.layout and view.buffers is opt.buffers


def test_the_views_thresholds_are_the_optimizers_live_ones_both_ways():
    _, opt = _engine()
    view = opt.checkpoint_view()
    opt.clip_grad = 0.5  # a user's change between steps, after the view was made
    assert view.thresholds() == (0.5, opt.grad_norm_skip_threshold)
    view.set_thresholds(2.0, 100.0)  # what a load sets
    assert (opt.clip_grad, opt.grad_norm_skip_threshold) == (2.0, 100.0)


def test_a_load_through_the_engine_sets_the_thresholds_it_saved():
    model, opt = _engine()
    opt.scale_loss(model(torch.ones(3, 4)).sum()).backward()
    opt.step()
    saved = opt.state_dict()
    opt.clip_grad, opt.grad_norm_skip_threshold = 7.0, 9.0
    opt.load_state_dict(saved)
    assert (opt.clip_grad, opt.grad_norm_skip_threshold) == (saved["clip_grad"], saved["grad_norm_skip_threshold"])
