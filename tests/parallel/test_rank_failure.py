"""A rank that dies (or goes silent) mid-run makes the others fail at their next collective
with ParallelError naming the call, within the group's timeout: no rank hangs."""

import pytest

from headwise.parallel import spawn

from . import ranks

TIMEOUT_S = 1.0  # the process group's timeout: how long a collective waits for a silent rank


@pytest.mark.parametrize("how", ["exit", "stall"])
def test_others_fail_fast_with_a_clear_error(how):
    outcomes = spawn(ranks.die_mid_run, 2, how, timeout_s=TIMEOUT_S, deadline_s=60, raise_on_failure=False)
    survivor = outcomes[0]
    assert survivor.ok, survivor.error  # it returned: the failure was caught, not a hang or a crash
    error, seconds = survivor.value["error"], survivor.value["seconds"]
    assert error is not None and error.startswith("ParallelError: rank 0 of 2: the all-reduce of layer 0 attention")
    assert "another rank exited or stopped answering" in error and "restart all of them" in error
    assert seconds < TIMEOUT_S + 10  # the group's timeout bounds the wait (slack for a busy machine)
    if how == "exit":
        assert not outcomes[1].ok and outcomes[1].error == "exited with code 3 before answering"
    else:
        assert outcomes[1].ok and outcomes[1].value == {"stalled": True}
