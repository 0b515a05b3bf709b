"""engine/worker/host_memory.py: the KV cache's zero-filled mapping and its background prefault."""

import threading

import torch

from engine.worker import host_memory


def test_zeros_is_ready_at_once_and_the_prefault_can_be_awaited():
    """The tensor is all zeros and writable before the prefault ends; wait_for_prefault returns once no
    prefault thread is left running, with the values intact."""
    t = host_memory.zeros((64, 1024, 256), torch.float32)  # 64 MiB: four prefault chunks
    assert t.shape == (64, 1024, 256) and t.is_contiguous() and not t.any()
    t[3, 7, 11] = 2.5
    host_memory.wait_for_prefault()
    assert not any(th.name == "kv-prefault" and th.is_alive() for th in threading.enumerate())
    assert t[3, 7, 11] == 2.5 and t.sum() == 2.5
