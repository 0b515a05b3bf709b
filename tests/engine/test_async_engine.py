"""AsyncEngine: streaming through per-request queues, aborts, and surviving a failed step."""

import asyncio

import pytest

from engine import AsyncEngine, EngineConfig, EngineStepError, SamplingParams
from tests.conftest import assert_no_leak


@pytest.fixture(scope="module")
async def engine():
    eng = AsyncEngine(EngineConfig(dtype="float32", kv_cache_memory=64 << 20))
    await eng.start()
    yield eng
    await eng.shutdown()


async def collect(engine, prompt, params, rid):
    return [out async for out in engine.generate(prompt, params, rid)]


async def test_streams_cumulative_outputs_concurrently(engine, llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    results = await asyncio.gather(*(collect(engine, p, params, f"s{i}") for i, p in enumerate(prompts)))
    offline = llm.generate(prompts, params, use_tqdm=False)
    for outs, ref in zip(results, offline):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert outs[-1].metrics.first_token_time >= outs[-1].metrics.arrival_time
    assert_no_leak(engine.engine)


async def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    gen = engine.generate("Tell me a long story.", SamplingParams(max_tokens=500, ignore_eos=True), "leaver")
    async for out in gen:
        if len(out.outputs[0].token_ids) >= 3:
            break
    await gen.aclose()
    for _ in range(50):
        if not engine.engine.request_ids():
            break
        await asyncio.sleep(0.02)
    assert_no_leak(engine.engine)
    assert engine.is_alive


async def test_bad_prompt_raises_before_streaming(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        await collect(engine, [5] * (engine.max_model_len + 1), SamplingParams(), "too-long")


async def test_failed_step_fails_only_its_requests(engine):
    executor = engine.engine.engine_core.executor
    original = executor.execute_model

    def broken(*args):
        executor.execute_model = original  # fail once
        raise RuntimeError("injected fault")

    executor.execute_model = broken
    with pytest.raises(EngineStepError):
        await collect(engine, "Hello", SamplingParams(max_tokens=4), "doomed")
    assert_no_leak(engine.engine)
    outs = await collect(engine, "Hello", SamplingParams(max_tokens=4, ignore_eos=True), "fine")
    assert len(outs[-1].outputs[0].token_ids) == 4 and engine.is_alive
