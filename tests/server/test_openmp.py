"""The server's engine thread gets the only OpenMP team: release_thread_team ends the calling thread's."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from speculative.server.openmp import release_thread_team


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(
    sys.platform != "linux" or torch.get_num_threads() < 2, reason="libgomp's teams, counted in /proc"
)
def test_releasing_a_threads_team_ends_its_threads() -> None:
    """In a thread of its own (a team of its own): a parallel region starts torch.get_num_threads() - 1
    threads, which end when the thread releases its team."""
    seen: dict = {}

    def run() -> None:
        before = _threads()
        torch.ones(1_000_000).add_(1)  # a parallel region: this thread's team starts
        seen["started"] = _threads() - before
        seen["released"] = release_thread_team()
        deadline = time.monotonic() + 5
        while _threads() > before and time.monotonic() < deadline:  # the team's threads exit
            time.sleep(0.01)
        seen["left"] = _threads() - before

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == {"started": torch.get_num_threads() - 1, "released": True, "left": 0}
