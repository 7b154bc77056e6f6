"""A helper thread's torch thread count stays its own (engine/runtime/threads.py): the fused pass's workers (one thread
each) and a stream's worker with a share of the cores leave threads started afterwards on the process default."""

import threading

import pytest
import torch

from megatrain.engine.runtime import threads
from megatrain.engine.runtime.stream import CopyStream, Trace
from megatrain.engine.update import fused


def in_new_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a default above 1, so a helper's 1 leaking into it shows
    yield
    torch.set_num_threads(before)


def test_torch_set_num_threads_in_a_helper_leaks_into_later_threads(two_threads):
    # The behaviour set_team works around (if torch changes it, this says so): the control for the tests below.
    assert in_new_thread(lambda: (torch.set_num_threads(1), torch.get_num_threads())[1]) == 1
    assert in_new_thread(torch.get_num_threads) == 1
    torch.set_num_threads(2)
    assert in_new_thread(torch.get_num_threads) == 2


def test_set_team_is_this_threads_alone(two_threads):
    assert in_new_thread(lambda: (threads.set_team(1), torch.get_num_threads())[1]) == 1
    assert in_new_thread(torch.get_num_threads) == 2
    assert torch.get_num_threads() == 2


def test_fused_workers_take_one_thread_and_leave_later_threads_alone(two_threads):
    pool = fused.workers(3)  # a pool of its own size: new workers, whose initializer runs now
    seen = list(pool.map(lambda _: torch.get_num_threads(), range(6)))
    assert seen == [1] * 6
    assert in_new_thread(torch.get_num_threads) == 2
    fused.workers(2)  # back to the size the rest of the suite uses


def test_stream_worker_team_is_its_own(two_threads):
    stream = CopyStream("reduce", torch.device("cpu"), Trace(False))
    stream.threads = 1
    seen = []

    def job() -> int:
        seen.append(torch.get_num_threads())
        return 0

    stream.submit(job, (), "reduce", 0)
    stream.synchronize()
    assert seen == [1]
    assert in_new_thread(torch.get_num_threads) == 2


def test_without_an_openmp_runtime_torchs_call_is_used(two_threads, monkeypatch):
    monkeypatch.setattr(threads, "_omp_set_num_threads", lambda: None)
    assert in_new_thread(lambda: (threads.set_team(1), torch.get_num_threads())[1]) == 1


def test_a_team_of_none_is_refused():
    with pytest.raises(ValueError, match="at least 1 thread, got 0"):
        threads.set_team(0)


def test_one_pool_factory_gives_each_worker_a_team_of_one_and_grows_as_asked():
    from megatrain.engine.runtime.threads import WorkerPool, team

    grow, exact = WorkerPool("t-grow"), WorkerPool("t-exact", exact=True)
    try:
        first = grow.get(3)
        assert set(first.map(lambda _: team(), range(6))) == {1}  # each worker's torch ops on one thread
        assert grow.get(2) is first and grow.get(4) is not first  # grows, never shrinks
        e = exact.get(3)
        assert exact.get(3) is e and exact.get(2) is not e  # exactly the size asked
        with pytest.raises(ValueError, match="at least 1 thread"):
            grow.get(0)
    finally:
        grow.reset()
        exact.reset()
