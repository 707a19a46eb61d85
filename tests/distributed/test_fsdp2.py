"""graphstep as the optimizer of an FSDP2 (``fully_shard``) model, on 1, 2 and 4 gloo ranks: bitwise torch's fused
AdamW on the same FSDP2 model, every family against the whole model in one process (norm, num_zeros, params),
captured equal to eager, a NaN on one rank skipping the step everywhere, FSDP x TP and HSDP on 2 x 2 meshes, and
checkpoints through torch.distributed.checkpoint's get_state_dict / set_state_dict resharded 1 -> 2, 2 -> 4,
2 -> 1 and reloaded at the same size bitwise (graphstep/fsdp2/)."""

import pytest
import torch

import _fsdp2_workers as W
from _harness import spawn, values

pytestmark = pytest.mark.distributed

WORLDS = (2, 4)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """{world: rank 0's report}, and the 1-rank runs before and after: one spawn per world size, in the order
    the checkpoints need (saved on 1, loaded on 2 and saved, loaded on 4 and back on 1)."""
    root = str(tmp_path_factory.mktemp("fsdp2"))
    first = values(spawn(W.cases, 1, None, W.checkpoint_path(root, 1), timeout=120))
    two = values(spawn(W.cases, 2, W.checkpoint_path(root, 1), W.checkpoint_path(root, 2), timeout=240))
    four = values(spawn(W.cases, 4, W.checkpoint_path(root, 2), None, timeout=300))
    back = values(spawn(W.cases, 1, W.checkpoint_path(root, 2), None, timeout=120))
    return {"first": first, 2: two, 4: four, "back": back}


def _equal(found: list, expected: list) -> bool:
    return len(found) == len(expected) and all(torch.equal(a, b) for a, b in zip(found, expected))


@pytest.mark.parametrize("world", WORLDS)
def test_fused_adam_is_torchs_fused_adamw_on_the_same_fsdp2_model(reports, world):
    # Without clipping graphstep's fused kernel sees the very grads torch's does, for both reshard_after_forward
    # settings and with a bf16 MixedPrecisionPolicy that reduces in fp32: bitwise where both kernels round every
    # element alike (whole vector lanes), and drift-free to 1e-6 of the motion on the model with biases.
    for report in reports[world]:
        assert set(report["torch"]) == {(True, False), (True, True), (False, False), (False, True)}
        for case, found in report["torch"].items():
            assert found["bitwise"], (case, found["error"])
            assert all(found["applied"]), case
            assert found["drift"] < 1e-6, (case, found["drift"])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", list(W.FAMILY_CASES))
def test_every_family_matches_the_whole_model_in_one_process(reports, world, case):
    # The norm and num_zeros count each element once across ranks (FSDP2's padding rows and rank 3's empty
    # shards at 4 ranks included), so the clip and the update are the one-process run's; Muon orthogonalises
    # each whole matrix, gathered or by the distributed Newton-Schulz.
    for report in reports[world]:
        found = report["single"][case]
        records, expected = found["records"], found["expected"]
        assert [r[0] for r in records] == [r[0] for r in expected] == [True] * W.STEPS
        assert [r[1] for r in records] == pytest.approx([r[1] for r in expected], rel=1e-5)
        assert [r[2] for r in records] == [r[2] for r in expected]
        if not case.startswith("muon"):  # the 5-row model: some grads are exactly zero, so the count is tested
            assert any(r[2] for r in expected)
        assert found["error"] < 1e-5


@pytest.mark.parametrize("world", WORLDS)
def test_captured_equals_eager_and_a_nan_on_one_rank_skips_the_step_everywhere(reports, world):
    for report in reports[world]:
        eager, graph = report["capture"]["eager"], report["capture"]["graph"]
        assert graph["captured"] and not eager["captured"] and graph["recaptures"] == 0
        assert _equal(graph["params"], eager["params"])
        assert graph["records"][:W.NAN_STEP] == eager["records"][:W.NAN_STEP]
        for run in (eager, graph):
            assert [r[0] for r in run["records"]] == [step != W.NAN_STEP for step in range(W.STEPS)]
        before = W.NAN_STEP
        assert [r[1] for r in eager["records"][:before]] == pytest.approx(report["capture"]["expected_norms"][:before],
                                                                           rel=1e-5)


@pytest.mark.parametrize("world", WORLDS)
def test_a_constant_loss_scale_changes_no_bit(reports, world):
    assert all(report["capture"]["scaled_bitwise"] for report in reports[world])


@pytest.mark.parametrize("case", ["2d", "hsdp"])
def test_two_dimensional_meshes_match_the_whole_model(reports, case):
    # "2d": FSDP x TP. The LayerNorm's params lie on the "dp" sub-mesh and count on TP rank 0 only; the
    # row-parallel bias is replicated over "tp" and counts once too. "hsdp": every param replicated over one
    # mesh dimension, counted on its coordinate 0 only.
    for report in reports[4]:
        found = report[case]
        assert [r[0] for r in found["records"]] == [True] * W.STEPS
        assert [r[1] for r in found["records"]] == pytest.approx([r[1] for r in found["expected"]], rel=1e-5)
        assert [r[2] for r in found["records"]] == [r[2] for r in found["expected"]]
        assert found["error"] < 1e-5


def _check_resumed(loaded: dict, saved: dict, bitwise: bool) -> None:
    assert _equal(loaded["params"], saved["params"])
    assert loaded["state"].keys() == saved["state"].keys()
    assert all(torch.equal(loaded["state"][k], saved["state"][k]) for k in saved["state"])
    # Loaded in place into a captured step: it replays on, never recaptured.
    assert loaded["captured_before"] and loaded["captured"] and loaded["recaptures"] == 0
    if bitwise:
        assert _equal(loaded["continued"], saved["continued"])
    else:
        assert W.relative_error(loaded["continued"], saved["continued"]) < 1e-5


@pytest.mark.parametrize("saved_on, loaded_on", [(1, 2), (2, 4), (2, 1)])
def test_dcp_checkpoint_through_get_and_set_state_dict_reshards(reports, saved_on, loaded_on):
    saved = (reports["first"] if saved_on == 1 else reports[saved_on])[0]["saved"]
    runs = reports["back"] if loaded_on == 1 else reports[loaded_on]
    for report in runs:
        _check_resumed(report["loaded"], saved, bitwise=False)


@pytest.mark.parametrize("world", [1, 2])
def test_dcp_checkpoint_reloaded_at_the_same_size_resumes_bitwise(reports, world):
    for report in reports["first"] if world == 1 else reports[world]:
        _check_resumed(report["reloaded"], report["saved"], bitwise=True)


@pytest.mark.parametrize("world", WORLDS)
def test_muon_refuses_matrices_split_unevenly_and_meshes_of_several_dimensions(reports, world):
    for report in reports[world]:
        refused = report["muon_refusals"]
        assert "param 'up.weight' has 5 rows over" in refused["uneven"] and "splits evenly" in refused["uneven"]
        if world == 4:
            assert "not on a mesh of several dimensions" in refused["two_dimensional"]


@pytest.mark.parametrize("world", WORLDS)
def test_torchs_full_state_dict_round_trips_into_a_fresh_optimizer(reports, world):
    # StateDictOptions(full_state_dict=True): torch gathers graphstep's DTensor state into whole tensors, and
    # set_state_dict scatters them back into another optimizer's buffers.
    for report in reports[world]:
        assert report["full_state_dict"] == {"full_tensors": True, "state_equal": True, "params_equal": True}
