"""Tensor parallelism: every grad element counted once in the norm, the clip and num_zeros across the
tensor-parallel ranks (graphstep/plan/model_parallel.py), against the unsplit model in one process."""

import pytest

import _tp_workers
from _harness import spawn, values

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("extra", [None, {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}],
                         ids=["device", "cpu-offload"])
def test_norm_clip_zero_count_and_skip_equal_the_unsplit_model(extra):
    # Replicated params (the row-parallel bias, the LayerNorm) count on TP rank 0 only: counted on both ranks,
    # as before tensor_parallel_group existed, the norm came out larger than the unsplit model's. A NaN in a
    # replicated grad on the last rank alone (not counted there) still skips the step on both ranks.
    skipped = [step == _tp_workers.NAN_STEP for step in range(_tp_workers.LONG_STEPS)]
    for report in values(spawn(_tp_workers.tensor_parallel, 2, extra, timeout=90)):
        reference = report["reference"]
        assert reference["applied"] == [not s for s in skipped]
        for capture, found in report["found"].items():
            assert found["captured"] == (capture == "graph")
            assert found["applied"] == reference["applied"], (capture, found)
            assert found["norms"] == pytest.approx(reference["norms"], rel=1e-5), (capture, report)
            assert found["zeros"] == reference["zeros"] and min(reference["zeros"]) >= _tp_workers.D, report
        assert report["worst_param_error"] < 1e-5, report
        assert report["captured_equals_eager"], report


def test_what_tensor_parallelism_cannot_do_is_refused():
    for found in values(spawn(_tp_workers.refusals, 2, timeout=60)):
        assert "no tensor_parallel_group was given" in found["marks"] and "up.weight" in found["marks"], found
        assert "no expert_tensor_parallel_group was given" in found["experts"], found
        assert "Muon would gather its slices over the wrong group" in found["muon_experts"], found
        assert "no trainable param is marked as an expert param" in found["expert_group_without_experts"], found
        # the TP slices share param names: one checkpoint would keep one rank's entries (nothing is written)
        assert "share param names" in found["checkpoint"], found


@pytest.mark.parametrize("capture, overlap, optimizer", [("eager", False, "adam"), ("graph", False, "adam"),
                                                         ("eager", True, "adam"), ("graph", False, "muon")])
def test_tensor_times_data_parallel_on_four_ranks_equals_the_unsplit_model(capture, overlap, optimizer):
    for report in values(spawn(_tp_workers.tensor_and_data_parallel, 4, capture, overlap, optimizer, timeout=90)):
        assert report["captured"] == (capture == "graph")
        assert (report["overlapped"] > 0) == overlap, report
        norms, zeros = zip(*report["found"])
        expected_norms, expected_zeros = zip(*report["expected"])
        assert norms == pytest.approx(expected_norms, rel=1e-5), report
        assert zeros == expected_zeros, report
        assert report["worst_param_error"] < 1e-5, report


@pytest.mark.parametrize("mode, capture", [("duplicated", "eager"), ("duplicated", "graph"),
                                           ("distributed", "graph"), ("blockwise", "eager")])
def test_muon_on_split_matrices_in_each_tp_mode(mode, capture):
    # duplicated and distributed orthogonalise the whole matrix (distributed from the slices, its sums in
    # another order); blockwise each slice alone, scaled by the whole matrix's shape.
    for report in values(spawn(_tp_workers.muon_tensor_parallel, 2, mode, capture, timeout=90)):
        assert report["captured"] == (capture == "graph")
        if mode == "blockwise":
            assert report["blockwise_first_step"] < 1e-6, report
            assert report["worst_vs_whole"] > 1e-3, report  # not the whole-matrix update
        else:
            assert report["worst_vs_whole"] < 1e-5, report


def test_qk_clip_over_heads_split_across_tensor_parallel_ranks_equals_the_whole_attention():
    # Each TP rank holds its own heads (column-parallel Q and K): their maxima and the rows they clip are local,
    # so registering the local head layout is all it takes; captured here, against the whole attention eagerly.
    for report in values(spawn(_tp_workers.qk_clip_tensor_parallel, 2, timeout=90)):
        assert report["captured"], report
        assert report["q_moved"] > 1e-3, report  # the clip did act
        # bitwise: lr 0, and each head's logits are computed by the same ops on either side
        assert report["q_error"] == report["k_error"] == report["maxima_error"] == 0.0, report


def test_two_pipeline_stages_sharing_the_embedding_count_it_once():
    # The norm is summed over the pipeline (model-parallel) group: the last stage's copy of the embedding,
    # marked shared, counts on no rank, so the norm is the tied model's.
    for report in values(spawn(_tp_workers.pipeline_with_shared_embedding, 2, timeout=90)):
        assert report["captured"], report
        assert report["norms"] == pytest.approx(report["expected"], rel=1e-5), report
        assert report["worst_param_error"] < 1e-5, report


@pytest.mark.parametrize("mode", ["duplicated", "distributed"])
def test_muon_on_a_fused_qkv_weight_split_by_query_groups(mode):
    # Q, K and V are orthogonalised as three matrices of the whole weight: each rank's slice holds its query
    # groups, so each of the three is split along its rows.
    for report in values(spawn(_tp_workers.muon_fused_qkv_tensor_parallel, 2, mode, timeout=90)):
        assert report["captured"] and report["moved"] > 1e-3, report
        assert report["error"] < 1e-5, report
