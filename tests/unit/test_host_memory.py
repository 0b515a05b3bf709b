"""engine/worker/host_memory.py: the KV cache's zero-filled mapping and its background prefault."""

import threading

import pytest
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


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps; "hg": advised for huge pages)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_cache_starts_on_a_huge_page_advised_for_them():
    """The KV cache's mapping starts at a 2 MiB boundary and, where the kernel gives transparent huge pages, is
    advised for them (a decode step's K/V reads stay within the TLB's reach)."""
    t = host_memory.zeros((3, 1 << 20), torch.bfloat16)
    host_memory.wait_for_prefault()
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    assert ("hg" in _vm_flags(t.data_ptr())) == host_memory.huge_pages_on()


def test_the_weights_move_into_huge_pages_and_compute_the_same(llm, monkeypatch):
    """Every weight of the default model (its parameters and GGUF blocks, R16-repacked ones among them) lies in
    one mapping advised for huge pages, and the engine computes with them what an engine whose weights stayed
    where they were loaded computes: greedy tokens and logprobs equal."""
    from engine import SamplingParams
    from tests.engines import make_llm

    if not host_memory.huge_pages_on():
        pytest.skip("the kernel gives no transparent huge pages (THP mode never)")
    model = llm.engine.engine_core.executor.runner.model
    weights = [getattr(owner, name) for owner, name in host_memory._weights(model)]
    assert sum(w.nbytes for w in weights) > 50 << 20
    assert all("hg" in _vm_flags(w.data_ptr()) for w in weights)
    monkeypatch.setattr(host_memory, "huge_page_weights", lambda model: 0)
    plain = make_llm()
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], list(range(100, 140))]
    for a, b in zip(llm.generate(prompts, params, use_tqdm=False), plain.generate(prompts, params, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]


def _mapping_name(address: int) -> str:
    """The pathname column of this process's mapping that holds `address` ("[heap]" for malloc's main heap)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5] if len(fields) > 5 else ""
    return "?"


def test_large_step_outputs_come_from_the_heap_kept_between_steps():
    """After keep_freed_memory, a 96 MB allocation (past the 32 MB from which glibc maps each one apart, where a
    step's outputs took fresh zeroed pages every step) comes from malloc's heap, freed it is not given back (the
    heap is not trimmed below it), and the next one comes from the heap too."""
    if not host_memory.keep_freed_memory():
        pytest.skip("not glibc: no mallopt")
    first = torch.empty(96 << 20, dtype=torch.uint8)
    address = first.data_ptr()
    assert _mapping_name(address) == "[heap]"
    first.fill_(1)
    del first
    assert _mapping_name(address) == "[heap]"  # not unmapped or trimmed
    again = torch.empty(96 << 20, dtype=torch.uint8)
    assert _mapping_name(again.data_ptr()) == "[heap]"
