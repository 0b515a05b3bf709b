"""The synchronous engine: requests in, one scheduled model step at a time, outputs out. It wires vLLM v1's
three parts: the input processor (validation, tokenization, n fan-out, grammar compilation), the engine core
(scheduler and executor) and the output processor (text, stop strings, logprobs, metrics)."""

import itertools
import logging
import time

from transformers import GenerationConfig

from engine.config import EngineConfig
from engine.engine_core import EngineCore, EngineStepError, KVTransferError
from engine.input_processor import InputProcessor
from engine.output_processor import OutputProcessor
from engine.outputs import EngineStats, ModelDetails, RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec_decode.draft_model import check_draft_model
from engine.structured.manager import StructuredOutputManager
from models.gguf import is_gguf
from models.loader import load_config, load_tokenizer, resolve_model

logger = logging.getLogger(__name__)

__all__ = ["EngineStepError", "KVTransferError", "LLMEngine"]


class LLMEngine:
    """Input processor + engine core + output processor, driven by `step()`.

    A request with n > 1 becomes n scheduler requests (ids "<id>#<i>") that share the prompt's KV blocks
    through the prefix cache; outputs are reported per request id with the samples that changed.
    Raises ValueError (a bad setting or model), OSError (a missing model) and EngineDeadError (a
    tensor-parallel rank that failed to start) from the constructor.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        start = time.perf_counter()
        self.model_dir = resolve_model(config.model)
        if config.quantization == "gguf" and config.tensor_parallel_size > 1:
            raise ValueError(
                "quantization gguf runs in one process: tensor_parallel_size > 1 needs the "
                "weights dequantized at load (quantization none, the default with tensor parallelism)"
            )
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        hf_config = load_config(self.model_dir)
        config_done = time.perf_counter()
        self.tokenizer = load_tokenizer(self.model_dir, config.tokenizer)
        tokenizer_done = time.perf_counter()
        self.vocab_size = hf_config.vocab_size
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            check_draft_model(spec.model, self.vocab_size, self.tokenizer)
        self.eos_token_ids = self._eos_token_ids(hf_config)
        self.structured = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.eos_token_ids, config.structured_outputs_config
        )
        self.engine_core = EngineCore(config, hf_config, self.model_dir, self.structured)
        runner = self.engine_core.executor.runner
        logger.info(
            "engine built in %.2fs: model config %.2fs, tokenizer %.2fs, model and KV cache %.2fs",
            time.perf_counter() - start,
            config_done - start,
            tokenizer_done - config_done,
            time.perf_counter() - tokenizer_done,
        )
        self.max_model_len = self.engine_core.max_model_len
        self.num_kv_blocks = self.engine_core.num_blocks
        self.hidden_size = runner.shape.hidden_size  # of an embedding
        self.device, self.dtype = runner.device, runner.dtype
        self.details = ModelDetails(
            architecture=hf_config.model_type,
            file_format="gguf" if is_gguf(self.model_dir) else "safetensors",
            num_parameters=runner.num_parameters,
            weight_formats=dict(runner.weight_bytes),
            kv_cache_bytes=runner.kv_cache.nbytes,
        )
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            self.eos_token_ids,
            self.structured,
            self.engine_core.kv_connector,
            config.pooler_config.pooling_type,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        logger.info(
            "model %s: %s on %s, %s attention, %d KV blocks of %d tokens (%d tokens), max_model_len %d",
            self.model_name,
            str(self.dtype).removeprefix("torch."),
            self.device,
            type(runner.backend).__name__,
            self.num_kv_blocks,
            config.block_size,
            self.num_kv_blocks * config.block_size,
            self.max_model_len,
        )

    def _eos_token_ids(self, hf_config) -> frozenset[int]:
        try:
            gen = None if is_gguf(self.model_dir) else GenerationConfig.from_pretrained(self.model_dir)
        except OSError:  # no generation_config.json
            gen = None
        ids = set()
        for source in (gen, hf_config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if value is not None:
                ids.update(value if isinstance(value, (list, tuple)) else [value])
        return frozenset(ids)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt; raises ValueError as InputProcessor.tokenize does."""
        return self.input_processor.tokenize(prompt)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
        pooling: bool = False,
    ) -> str:
        """Queues a request (n sequences); returns its id. `prompt_token_ids`: the prompt already
        tokenized by `tokenize` (else it is tokenized here). With `pooling`, an embedding request: the
        prompt alone is computed (params must have max_tokens 0) and its final output carries the
        pooled, normalised hidden state (`RequestOutput.embedding`, per --pooler-config).

        Raises ValueError for bad input, including a structured-outputs constraint that does not
        compile (this waits for its compile, compile_timeout seconds at most).
        """
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival_time = arrival_time or time.monotonic()
        ids, requests = self.input_processor.process(
            request_id, prompt, params, arrival_time, prompt_token_ids, pooling
        )
        self.output_processor.add_request(
            request_id, prompt, ids, [(r.request_id, r.params) for r in requests], arrival_time
        )
        for req in requests:
            self.engine_core.add_request(req)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request at once and frees its blocks; returns its final output (None if unknown)."""
        output, ids = self.output_processor.abort_request(request_id)
        self.engine_core.finish_requests(ids, "abort")
        return output

    def request_ids(self) -> list[str]:
        """The ids of the requests not finished yet."""
        return list(self.output_processor.parents)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block hash (benchmarks repeating prompts; vLLM's name)."""
        self.engine_core.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def kv_poll_interval(self) -> float | None:
        """Seconds an idle engine may wait before `step` must run again to move KV transfers on
        (None: nothing to watch)."""
        return self.engine_core.kv_connector.poll_interval()

    @property
    def dead_error(self) -> str | None:
        """Why the engine can run no more steps (a tensor-parallel rank died), or None."""
        return self.engine_core.executor.error

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the outputs of requests that changed.

        Raises EngineStepError (its `request_ids` the requests' ids) after finishing the step's requests if
        the model step failed, and KVTransferError (before scheduling) for requests whose prompt K/V could
        not be pulled.
        """
        try:
            core_outputs = self.engine_core.step()
        except EngineStepError as e:
            parents, others = self.output_processor.drop(e.request_ids)
            self.engine_core.finish_requests(others, "abort")
            e.request_ids = parents
            raise
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        self.engine_core.finish_requests(stopped, "stop")
        return outputs

    def stats(self) -> EngineStats:
        core = self.engine_core
        s, connector = core.scheduler, core.kv_connector
        stats = s.spec_decoding_stats
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + connector.num_loading,
            kv_cache_usage=core.kv.usage,
            prefix_cache_queries=core.kv.prefix_cache_queries,
            prefix_cache_hits=core.kv.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens=s.num_prompt_tokens,
            generation_tokens=s.num_generation_tokens,
            prompt_tokens_by_source=dict(s.prompt_tokens_by_source),
            prompt_tokens_recomputed=s.num_prompt_tokens_recomputed,
            kv_transfer_failures=connector.num_failed_transfers,
            kv_expired_requests=connector.num_expired_requests,
            spec_decoding=stats.copy() if stats is not None else None,
        )

    def shutdown(self) -> None:
        """Stops the KV connector, the grammar compile pool and the executor's processes."""
        self.engine_core.shutdown()
        self.structured.shutdown()
