"""The synchronous engine: requests in, one scheduled model step at a time, outputs out."""
import itertools
import logging
import time

from transformers import GenerationConfig

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.step_io import SchedulerOutput
from engine.detokenizer import IncrementalDetokenizer
from engine.executor import build_executor
from engine.kv_transfer.connector import NixlConnector
from engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.snapshot import StepLog
from engine.spec_decode.speculator import NoSpeculation, Speculator
from engine.structured.manager import StructuredOutputManager
from engine.structured.matcher import RequestGrammar
from engine.worker import pooler
from models.gguf import is_gguf
from models.loader import load_config, load_tokenizer, resolve_model

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """A model step failed; the requests in it (`request_ids`, the ids given to add_request) are
    finished and their blocks freed; the engine keeps serving the others."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step failed: {cause!r}")
        self.request_ids = request_ids


class KVTransferError(EngineStepError):
    """The prompt K/V of these requests (`request_ids`) could not be pulled from their prefill server
    (`reason` says why); they are finished and their blocks freed."""

    def __init__(self, request_ids: list[str], reason: str):
        RuntimeError.__init__(self, reason)
        self.request_ids = request_ids
        self.reason = reason


class LLMEngine:
    """Scheduler + KV cache manager + executor, driven by `step()`.

    A request with n > 1 becomes n sequences (ids "<id>#<i>") that share the prompt's KV blocks
    through the prefix cache; outputs are reported per request id with the changed samples.
    The features plug in at fixed points of the step, each a no-op when off: the KV connector before
    scheduling (in the scheduler), structured outputs before the forward (the grammar bitmask), the
    speculator after the update (next step's drafts).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        start = time.perf_counter()
        self.model_dir = resolve_model(config.model)
        if config.quantization == "gguf" and config.tensor_parallel_size > 1:
            raise ValueError("quantization gguf runs in one process: tensor_parallel_size > 1 needs the "
                             "weights dequantized at load (quantization none, the default with tensor parallelism)")
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        hf_config = load_config(self.model_dir)
        config_done = time.perf_counter()
        self.tokenizer = load_tokenizer(self.model_dir, config.tokenizer)
        tokenizer_done = time.perf_counter()
        self.executor = build_executor(config, hf_config, self.model_dir)
        self.runner = self.executor.runner  # rank 0's: the KV cache, dtype, device and limits
        logger.info("engine built in %.2fs: model config %.2fs, tokenizer %.2fs, model and KV cache %.2fs",
                    time.perf_counter() - start, config_done - start, tokenizer_done - config_done,
                    time.perf_counter() - tokenizer_done)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = hf_config.vocab_size
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_connector = (NixlConnector(config.kv_transfer_config, self.runner.kv_cache, config.block_size)
                             if config.kv_transfer_config else None)
        self.speculator = NoSpeculation()
        if config.speculative_config is not None:
            self.speculator = Speculator(config.speculative_config, config, self.runner, self.tokenizer,
                                         self.max_model_len)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   self.kv_connector, on_free=self.speculator.free)
        self.eos_token_ids = self._eos_token_ids(hf_config)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                  config.structured_outputs_config)
        self.groups: dict[str, list[Request]] = {}
        self.step_log = StepLog()  # recent steps, for the dashboard
        self._ids = itertools.count()
        logger.info("model %s: %s on %s, %s attention, %d KV blocks of %d tokens (%d tokens), max_model_len %d",
                    self.model_name, str(self.runner.dtype).removeprefix("torch."), self.runner.device,
                    type(self.runner.backend).__name__,
                    self.runner.num_blocks, config.block_size, self.runner.num_blocks * config.block_size,
                    self.max_model_len)

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
        """Token ids of a prompt (a string is encoded with the tokenizer's special tokens, as HF does).

        Raises ValueError for an empty prompt, ids outside the vocabulary, or a prompt that leaves no
        room for one output token within max_model_len.
        """
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             f"(prompt + at least 1 output token)")
        return ids

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, prompt_token_ids: list[int] | None = None,
                    pooling: bool = False) -> str:
        """Queues a request (n sequences); returns its id. `prompt_token_ids`: the prompt already
        tokenized by `tokenize` (else it is tokenized here). With `pooling`, an embedding request: the
        prompt alone is computed (params must have max_tokens 0) and its final output carries the
        pooled, normalised hidden state (`RequestOutput.embedding`, per --pooler-config).

        Raises ValueError for bad input, including a structured-outputs constraint that does not
        compile (this waits for its compile, compile_timeout seconds at most).
        """
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
            if any(t >= self.vocab_size for t in ids):
                raise ValueError(f"{name} token ids must be below the vocabulary size {self.vocab_size}")
        if pooling and (params.max_tokens != 0 or params.n != 1):
            raise ValueError("an embedding request computes its prompt alone: max_tokens 0 and n 1")
        if params.prompt_logprobs is not None and not self.executor.supports_prompt_logprobs:
            raise ValueError(f"prompt_logprobs is not supported by {type(self.executor).__name__}")
        ids = prompt_token_ids or self.tokenize(prompt)
        if self.kv_connector is not None:
            self.kv_connector.check_request((params.extra_args or {}).get("kv_transfer_params"), len(ids), params.n)
        compiled = self.structured.compile_and_wait([params.structured_outputs])[0] \
            if params.structured_outputs else None
        text = prompt if isinstance(prompt, str) else None
        arrival = arrival_time or time.monotonic()
        group = []
        for i in range(params.n):
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.include_stop_str_in_output,
                                           params.skip_special_tokens)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            grammar = RequestGrammar(compiled) if compiled is not None else None
            group.append(Request(seq_id, request_id, i, text, ids, params, detok, self.eos_token_ids, arrival,
                                 grammar, self.config.pooler_config.pooling_type if pooling else None))
        self.groups[request_id] = group
        for req in group:
            self.scheduler.add_request(req)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request at once and frees its blocks; returns its final output (None if unknown)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for req in group:
            if not req.is_finished:
                self.scheduler.finish(req, "abort")
        return self._output(group, group)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block hash (benchmarks repeating prompts; vLLM's name)."""
        self.kv.pool.uncache(self.kv.pool.blocks)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def kv_poll_interval(self) -> float | None:
        """Seconds an idle engine may wait before `step` must run again to move KV transfers on
        (None: nothing to watch)."""
        return self.kv_connector.poll_interval() if self.kv_connector is not None else None

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the outputs of requests that changed.

        Raises EngineStepError after finishing the step's requests if the model step failed, and
        KVTransferError (before scheduling) for requests whose prompt K/V could not be pulled.
        """
        start = time.monotonic()
        self._fail_kv_transfers(self.scheduler.update_from_kv_connector())
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.requests:
            return []
        self.structured.fill_bitmask(scheduler_output)
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except Exception as e:
            self._fail_step(scheduler_output, e)
        changed = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.scheduler.update_draft_token_ids(
            self.speculator.propose(scheduler_output, runner_output, len(self.scheduler.running)))
        self.step_log.record(scheduler_output, start, self.scheduler.num_preemptions)
        return self._outputs(changed)

    def _fail_kv_transfers(self, failed: list[tuple[Request, str]]) -> None:
        """Raises KVTransferError for the requests whose prompt K/V could not be pulled (already finished)."""
        if failed:
            parents = list(dict.fromkeys(req.parent_id for req, _ in failed))
            for parent in parents:
                self.groups.pop(parent, None)
            raise KVTransferError(parents, "; ".join(dict.fromkeys(reason for _, reason in failed)))

    def _fail_step(self, scheduler_output: SchedulerOutput, error: Exception):
        """Finishes every request of a failed step (their blocks freed and uncached: their K/V may be
        garbage) and raises EngineStepError."""
        logger.exception("engine step failed; failing its %d requests", len(scheduler_output.requests))
        parents = list(dict.fromkeys(r.parent_id for r in scheduler_output.requests))
        for parent in parents:
            for req in self.groups.pop(parent, []):
                if not req.is_finished:
                    self.scheduler.finish(req, "abort", uncache=True)
        raise EngineStepError(parents, error) from error

    def _outputs(self, changed: list[Request]) -> list[RequestOutput]:
        by_parent: dict[str, list[Request]] = {}
        for req in changed:
            by_parent.setdefault(req.parent_id, []).append(req)
        outputs = []
        for parent, reqs in by_parent.items():
            out = self._output(self.groups[parent], reqs)
            if out.finished:
                del self.groups[parent]
            outputs.append(out)
        return outputs

    def _output(self, group: list[Request], changed: list[Request]) -> RequestOutput:
        first = group[0]
        completions = [CompletionOutput(
            index=r.index, text=r.detokenizer.output_text(r.is_finished), token_ids=list(r.output_token_ids),
            cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
            logprobs=list(r.logprobs) if r.logprobs is not None else None,
            finish_reason=r.finish_reason, stop_reason=r.stop_reason) for r in changed]
        finished = all(r.is_finished for r in group)
        metrics = first.metrics if len(group) == 1 else RequestMetrics.merge([r.metrics for r in group])
        if finished:
            metrics.finished_time = time.monotonic()
        prompt_logprobs = first.prompt_logprobs
        if prompt_logprobs is not None and len(prompt_logprobs) < first.num_prompt_tokens:
            prompt_logprobs = None  # aborted before its prompt was computed
        embedding = None
        if first.pooling and finished and first.finish_reason == "length":  # not aborted
            embedding = pooler.finish(first.pooled, first.num_prompt_tokens, self.config.pooler_config)
        return RequestOutput(first.parent_id, first.prompt, first.prompt_token_ids, completions, finished,
                             max(first.num_cached_tokens, 0), metrics, prompt_logprobs,
                             first.kv_transfer_params if finished else None, embedding)

    def stats(self) -> EngineStats:
        s = self.scheduler
        loading = self.kv_connector.num_loading if self.kv_connector else 0  # waiting for their prompt's K/V
        return EngineStats(num_running=len(s.running), num_waiting=len(s.waiting) + loading, kv_cache_usage=self.kv.usage,
                           prefix_cache_queries=self.kv.prefix_cache_queries,
                           prefix_cache_hits=self.kv.prefix_cache_hits, num_preemptions=s.num_preemptions,
                           prompt_tokens=s.num_prompt_tokens, generation_tokens=s.num_generation_tokens,
                           prompt_tokens_by_source=dict(s.prompt_tokens_by_source),
                           prompt_tokens_recomputed=s.num_prompt_tokens_recomputed,
                           kv_transfer_failures=self.kv_connector.num_failed_transfers if self.kv_connector else 0,
                           kv_expired_requests=self.kv_connector.num_expired_requests if self.kv_connector else 0,
                           spec_decoding=self.speculator.stats.copy() if self.speculator.stats is not None else None)
