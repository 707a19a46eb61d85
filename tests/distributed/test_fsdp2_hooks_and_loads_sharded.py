"""graphstep's FSDP2 optimizer on 2 gloo ranks: hooks a user registers on the model's params after the build
run beside the engine's, and a load damaged on one rank is refused on every rank with nothing changed
(graphstep/fsdp2/; the one-rank tests: tests/test_fsdp2_hooks_and_loads.py)."""

import pytest

import _fsdp2_hooks_and_loads_workers as W
from _harness import spawn, values

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def reports():
    return values(spawn(W.cases, 2, timeout=120))


def test_a_users_hooks_registered_after_the_build_run_and_leave_the_steps_unchanged(reports):
    for report in reports:
        assert report["hooks"] == {"calls_per_step_right": True, "steps_equal": True}


def test_a_state_dict_damaged_on_one_rank_is_refused_on_every_rank_and_changes_nothing(reports):
    damaged, other = reports[1]["damaged"], reports[0]["damaged"]
    assert "'exp_avg_sq'] (param " in damaged["error"] and "holds NaN or inf" in damaged["error"]
    assert "rank 1 refused its part of the FSDP2 optimizer state dict" in other["error"]
    assert damaged["unchanged"] and other["unchanged"]
