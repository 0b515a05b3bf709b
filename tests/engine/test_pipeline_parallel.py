"""Pipeline parallelism (models/distributed/pipeline.py, engine/executor/multiproc.py) on the CPU over gloo:
greedy float32 tokens equal transformers' under the near-tie rule with PP=2 (batched, prompts chunked,
prefix-cache hits, preemption, two batches in flight), PP=3 and PP=2 x TP=3 on the default model dequantized,
and PP=2 serving the GGUF quantized equals one process on it; structured outputs through the last stage; a
killed stage failing the engine with its name; the layer split and the start-up errors."""

import json
import time

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from models.distributed.pipeline import PPMissingLayer, get_pp_indices
from scripts.make_tiny_model import save_tiny_model
from tests.conftest import assert_greedy_matches, make_llm
from tests.engines import kill_rank_and_expect_failure

THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _restore_threads():
    """Rank 0 sets torch's thread count for its whole process: the other tests get pytest's back."""
    yield
    torch.set_num_threads(THREADS)


def stop_workers(llm: LLM) -> None:
    llm.engine.engine_core.executor.shutdown()


def test_layers_split_as_vllm_splits_them():
    """Even splits; a remainder goes to the stages before the last, from the second-last back; an explicit
    partition; the errors."""
    assert [get_pp_indices(30, r, 2) for r in range(2)] == [(0, 15), (15, 30)]
    assert [get_pp_indices(30, r, 4) for r in range(4)] == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert [get_pp_indices(10, r, 3) for r in range(3)] == [(0, 3), (3, 7), (7, 10)]
    assert [get_pp_indices(30, r, 2, (10, 20)) for r in range(2)] == [(0, 10), (10, 30)]
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 is more than the model's 2 layers"):
        get_pp_indices(2, 0, 3)
    with pytest.raises(ValueError, match="must be 2 positive layer counts summing to the model's 30 layers"):
        get_pp_indices(30, 0, 2, (10, 10))


def test_start_up_errors(llm, tmp_path):
    """Refused before any rank starts: more stages than layers, a partition of the wrong length or not
    numbers, speculative decoding with stages."""
    save_tiny_model("llama3", tmp_path, llm.tokenizer, num_hidden_layers=2)
    start = time.monotonic()
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 is more than the model's 2 layers"):
        LLM(model=str(tmp_path), pipeline_parallel_size=3)
    assert time.monotonic() - start < 10
    with pytest.raises(ValueError, match="must give 2 layer counts"):
        EngineConfig(pipeline_parallel_size=2, pp_layer_partition="10,10,10")
    with pytest.raises(ValueError, match="comma-separated layer counts"):
        EngineConfig(pipeline_parallel_size=2, pp_layer_partition="half,half")
    with pytest.raises(ValueError, match="speculative_config is not supported with pipeline_parallel_size > 1"):
        EngineConfig(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.fixture(scope="module")
def pp2():
    """PP=2 float32, dequantized, with room for ~3 of the 8 prompts at once (preemption) and prompts chunked
    to 96 tokens; stage 0 holds 15 of the 30 layers, stage 1 the other 15 and the head."""
    llm = make_llm(pipeline_parallel_size=2, quantization="none", num_gpu_blocks_override=48, max_num_batched_tokens=96)
    yield llm
    stop_workers(llm)


def in_flight_counter(llm: LLM) -> list[int]:
    """Records how many steps are in flight each time one starts."""
    core = llm.engine.engine_core
    execute, seen = core.executor.execute_model, []

    def counted(*args):
        future = execute(*args)
        seen.append(len(core.batch_queue) + 1)
        return future

    core.executor.execute_model = counted
    return seen


@pytest.mark.slow
def test_pp2_greedy_matches_the_reference(pp2, prompts, hf_reference):
    """Batched, chunked, preempted, two steps in flight; then the same prompts again from the prefix cache."""
    runner = pp2.engine.engine_core.executor.runner
    assert (runner.pp.start_layer, runner.pp.end_layer, runner.pp.is_last) == (0, 15, False)
    assert isinstance(runner.model.layers[15], PPMissingLayer) and isinstance(runner.model.norm, PPMissingLayer)
    assert runner.kv_cache.shape[0] == 15  # this stage's layers only
    seen = in_flight_counter(pp2)
    core = pp2.engine.engine_core
    params = SamplingParams(temperature=0, max_tokens=32)
    for attempt in range(2):
        outs = pp2.generate(prompts, params, use_tqdm=False)
        for out, ref in zip(outs, hf_reference):
            assert_greedy_matches(out.outputs[0].token_ids, ref)
        if attempt == 0:
            assert core.scheduler.num_preemptions > 0 and max(seen) == 2
    assert core.kv.prefix_cache_hits > 0


@pytest.mark.slow
def test_pp2_structured_output_is_sampled_on_the_last_stage(pp2):
    """The grammar masks travel with the step to the last stage, which samples under them."""
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema))
    outs = pp2.generate(["A color as JSON:", "The sky is", "Grass is"], params, use_tqdm=False)
    for out in outs:
        assert json.loads(out.outputs[0].text)["color"] in ("red", "green", "blue")


@pytest.mark.slow
def test_pp3_greedy_matches_the_reference_and_a_killed_stage_fails_the_engine(prompts, hf_reference):
    """10 + 10 + 10 layers; then the middle stage is killed: the next step fails naming it, within seconds,
    the last stage is stopped too, and the engine stays dead."""
    pp3 = make_llm(pipeline_parallel_size=3, quantization="none")
    try:
        outs = pp3.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
        for out, ref in zip(outs, hf_reference):
            assert_greedy_matches(out.outputs[0].token_ids, ref)
        kill_rank_and_expect_failure(pp3, 0, "rank 1 (pipeline stage 1)")  # the middle stage
    finally:
        stop_workers(pp3)


@pytest.mark.slow
def test_pp2_tp3_greedy_matches_the_reference(prompts, hf_reference):
    """Six ranks: each stage's 15 layers split over three tensor-parallel ranks (3 query / 1 KV head each)."""
    llm = make_llm(pipeline_parallel_size=2, tensor_parallel_size=3, quantization="none")
    try:
        attn = llm.engine.engine_core.executor.runner.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (3, 1)
        outs = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        for out, (tokens, gaps) in zip(outs, hf_reference):
            assert_greedy_matches(out.outputs[0].token_ids, (tokens[:16], gaps[:16]))
    finally:
        stop_workers(llm)


@pytest.mark.slow
def test_pp2_serves_the_gguf_quantized_as_one_process_does(llm, prompts):
    """Each stage keeps its layers' Q4_1 blocks (the C kernels): the same tokens as one process."""
    params = SamplingParams(temperature=0, max_tokens=16)
    refs = llm.generate(prompts[:3], params, use_tqdm=False)
    pp = make_llm(pipeline_parallel_size=2)
    try:
        runner = pp.engine.engine_core.executor.runner
        assert runner.model.quantized and runner.weight_bytes["Q4_1"] > 0
        for out, ref in zip(pp.generate(prompts[:3], params, use_tqdm=False), refs):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    finally:
        stop_workers(pp)
