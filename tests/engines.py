"""The engines the tests make, one registry for every test module (conftest.py checks them after each test).

A test module that imports `make_llm` from `conftest` and one that imports it from `tests.conftest` get two
module objects of conftest.py; the registry lives here, in one module, so that both register into the list
the leak check reads. Engines are held weakly: one that no fixture or test holds any more is dropped (its KV
cache freed) instead of piling up over a run.
"""

import gc
import weakref

from engine import LLM

ENGINES: weakref.WeakSet = weakref.WeakSet()  # every LLM alive that a test made


def make_llm(**kwargs) -> LLM:
    """An LLM on the default model in float32 with a small KV cache unless told otherwise."""
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("kv_cache_memory", 128 << 20)
    if len(ENGINES) > 8:
        gc.collect()  # engines the finished tests dropped go now, with their caches
    llm = LLM(**kwargs)
    ENGINES.add(llm)
    return llm


def assert_no_leak(engine) -> None:
    """Every block is back in the free pool with ref count zero, and no request is left: not in the output
    processor, not in the scheduler, and in the worker only those whose finish the next step tells it."""
    assert not engine.request_ids(), f"requests left: {engine.request_ids()}"
    core = engine.engine_core
    assert not core.scheduler.running and not core.scheduler.waiting and not core.scheduler.requests
    assert not engine.output_processor.samples
    kv = core.kv
    pool = kv.pool
    assert pool.num_free_blocks == len(pool.blocks) - (kv.null_block is not None)  # the null block is never free
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not kv.req_blocks and not kv.num_skipped and not kv.num_cached_blocks
    runner = core.executor.runner
    assert set(runner.input_batch.requests) <= core.scheduler._finished_req_ids


def kill_rank_and_expect_failure(llm: LLM, index: int, name: str) -> None:
    """SIGKILLs the engine's rank process `workers.procs[index]`; then a request fails within 30 s with
    EngineStepError naming it ("<name> (pid P) was killed by SIGKILL": whether the watchdog or the step sees
    it first, the request's blocks are freed), every other rank is stopped, and the engine stays dead."""
    import os
    import re
    import signal
    import time

    import pytest

    from engine import SamplingParams
    from engine.engine_core import EngineStepError

    workers = llm.engine.engine_core.executor.workers
    victim = workers.procs[index]
    os.kill(victim.pid, signal.SIGKILL)
    start = time.monotonic()
    message = re.escape(f"{name} (pid {victim.pid}) was killed by SIGKILL")
    with pytest.raises(EngineStepError, match=message):
        llm.generate(["Hello"], SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 30
    assert all(p.poll() is not None for p in workers.procs)
    with pytest.raises(EngineStepError, match=message):
        llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
