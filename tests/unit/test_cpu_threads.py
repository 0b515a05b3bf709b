"""torch's thread count on the CPU follows the cores the process may run on (taskset, a container's cpuset), not
the machine's (a 16-core host under `taskset -c 0,1` ran 16 threads on 2 cores)."""

import os

import pytest
import torch

from engine.config import EngineConfig
from engine.executor.abstract import use_cpu_threads


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_threads_follow_the_affinity(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
        use_cpu_threads(EngineConfig(), num_ranks=1)
        assert torch.get_num_threads() == 3
        use_cpu_threads(EngineConfig(), num_ranks=2)
        assert torch.get_num_threads() == 1
        use_cpu_threads(EngineConfig(num_threads=2), num_ranks=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
