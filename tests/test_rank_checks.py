"""``RankChecks`` names every check that failed, on every rank, and fails every rank alike."""

import pytest

from tests.conftest import WORLD, RankChecks


def test_a_failure_names_every_failed_check_and_its_rank():
    last = WORLD.Get_size() - 1
    checks = RankChecks()
    checks.that(1 + 1 == 2)
    checks.that(WORLD.Get_rank() != last)  # fails on the last rank only
    checks.that(
        WORLD.Get_rank() < 0,
    )
    checks.that(False, "named by hand")
    with pytest.raises(AssertionError) as caught:  # on every rank, the others' failures included
        checks.agree(WORLD, "the detail")
    message = str(caught.value).splitlines()[0]  # pytest adds the failed expression below it
    assert "1 + 1 == 2" not in message
    assert f"{last}: test_rank_checks.py:12: checks.that(WORLD.Get_rank() != last)" in message
    assert "test_rank_checks.py:13: checks.that( WORLD.Get_rank() < 0, )" in message
    assert message.count("named by hand (the detail)") == WORLD.Get_size()


def test_checks_that_hold_pass_on_every_rank():
    checks = RankChecks()
    assert checks.that(WORLD.Get_rank() >= 0)
    checks.agree(WORLD)
