"""A thread's idle OpenMP workers can be let go (the server's engine thread then has the cores to itself)."""
import os
import threading

import pytest
import torch

from mamba_draft.cpu_threads import release_openmp_workers


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="Linux, 2+ cores")
def test_a_threads_openmp_workers_end_when_released_and_come_back_when_needed():
    counts = {}

    def work() -> None:  # in a thread of its own: the test process's other threads keep their teams
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        before = _threads()
        expected = a @ a  # a parallel region: this thread's team starts
        counts["team"] = _threads() - before
        counts["released"] = release_openmp_workers()
        counts["after"] = _threads() - before
        counts["same"] = torch.equal(a @ a, expected)  # a new team computes as the first did

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert counts["team"] >= 1, "torch ran the product without a team of OpenMP workers"
    assert counts["released"] and counts["after"] == 0 and counts["same"]
