"""kernels.dist.launch: a launch returns every rank's result, and a rank that fails, dies or hangs
gives a clear error naming it, within the deadline, with every process killed."""
import time

import pytest

from kernels.dist.launch import (RankFailed, RankTimeout, exiting_worker, failing_worker, hanging_worker,
                                 launch)


def test_a_raising_rank_is_named_with_its_traceback():
    with pytest.raises(RankFailed, match=r"rank 1 failed:[\s\S]*ValueError: rank 1 was told to fail") as e:
        launch(failing_worker, 2, (1,), timeout=30)
    assert e.value.rank == 1


def test_a_hung_rank_is_named_after_the_deadline():
    t0 = time.perf_counter()
    with pytest.raises(RankTimeout, match=r"rank 0, 1 did not finish .* within 2 s; all processes were killed"):
        launch(hanging_worker, 2, (1,), timeout=2)
    assert time.perf_counter() - t0 < 60


def test_a_rank_that_dies_silently_is_named_with_its_exit_code():
    with pytest.raises(RankFailed, match=r"rank 1 failed: process exited with code 3 and no result"):
        launch(exiting_worker, 2, (1,), timeout=30, start_timeout=60)


def test_a_start_deadline_names_the_ranks_that_never_joined():
    with pytest.raises(RankTimeout, match=r"rank 0, 1 did not start and join the process group within 0.01 s"):
        launch(failing_worker, 2, (5,), start_timeout=0.01)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        launch(failing_worker, 0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        launch(failing_worker, 2, timeout=0)
    with pytest.raises(ValueError, match="fn must be a function defined at module level"):
        launch(lambda r, p: r, 2)
