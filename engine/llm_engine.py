"""The synchronous engine: requests in, one scheduled model step at a time, outputs out."""
import concurrent.futures
import itertools
import logging
import time

from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from engine.block_manager import KVCacheManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.distributed.launcher import build_runner
from engine.kv_transfer import NixlConnector
from engine.loader import resolve_model
from engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.snapshot import StepLog
from engine.spec_decode.speculator import Speculator
from engine.structured import RequestGrammar, StructuredOutputManager

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
    """Scheduler + KV cache manager + model runner, driven by `step()`.

    A request with n > 1 becomes n sequences (ids "<id>#<i>") that share the prompt's KV blocks
    through the prefix cache; outputs are reported per request id with the changed samples.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        start = time.perf_counter()
        self.model_dir = resolve_model(config.model)
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        config_done = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or self.model_dir)
        tokenizer_done = time.perf_counter()
        self.runner = build_runner(config, hf_config, self.model_dir)
        logger.info("engine built in %.2fs: model config %.2fs, tokenizer %.2fs, model and KV cache %.2fs",
                    time.perf_counter() - start, config_done - start, tokenizer_done - config_done,
                    time.perf_counter() - tokenizer_done)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = hf_config.vocab_size
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_connector = (NixlConnector(config.kv_transfer_config, self.runner.kv_cache, config.block_size)
                             if config.kv_transfer_config else None)
        self.speculator = None
        if config.speculative_config is not None:
            self.speculator = Speculator(config.speculative_config, config, self.runner, self.tokenizer,
                                         self.max_model_len)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.kv_connector,
                                   on_free=self.speculator.free if self.speculator is not None else None)
        self.eos_token_ids = self._eos_token_ids(hf_config)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                  config.structured_outputs_config)
        self.groups: dict[str, list[Request]] = {}
        self._compiling: list[str] = []  # ids of groups queued before their grammar had compiled
        self.generation_tokens = 0
        self.step_log = StepLog()  # recent steps, for the dashboard
        self._ids = itertools.count()
        logger.info("model %s: %s on %s, %s attention, %d KV blocks of %d tokens (%d tokens), max_model_len %d",
                    self.model_name, str(self.runner.dtype).removeprefix("torch."), self.runner.device,
                    type(self.runner.backend).__name__,
                    self.runner.num_blocks, config.block_size, self.runner.num_blocks * config.block_size,
                    self.max_model_len)

    def _eos_token_ids(self, hf_config) -> frozenset[int]:
        try:
            gen = GenerationConfig.from_pretrained(self.model_dir)
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
                    arrival_time: float | None = None) -> str:
        """Queues a request (n sequences); returns its id. Raises ValueError for bad input.

        A structured-output request waits in the queue until its grammar has compiled (on the manager's
        pool); if the compile fails there, the request finishes with "abort" (callers that want the error
        compile first: `structured.compile(spec)`, as `LLM.generate` and the server do).
        """
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
            if any(t >= self.vocab_size for t in ids):
                raise ValueError(f"{name} token ids must be below the vocabulary size {self.vocab_size}")
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            # rank 0 alone would compute the extra logits, which under tensor parallelism every rank must
            raise ValueError("prompt_logprobs is not supported with tensor_parallel_size > 1")
        ids = self.tokenize(prompt)
        if self.kv_connector is not None:
            self.kv_connector.check_request((params.extra_args or {}).get("kv_transfer_params"), len(ids), params.n)
        compiled = self.structured.compile(params.structured_outputs) if params.structured_outputs else None
        if compiled is not None and compiled.done() and compiled.exception() is not None:
            raise compiled.exception()
        text = prompt if isinstance(prompt, str) else None
        arrival = arrival_time or time.monotonic()
        group = []
        for i in range(params.n):
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.include_stop_str_in_output,
                                           params.skip_special_tokens)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            grammar = RequestGrammar(compiled) if compiled is not None else None
            group.append(Request(seq_id, request_id, i, text, ids, params, detok, self.eos_token_ids, arrival,
                                 grammar))
        self.groups[request_id] = group
        if compiled is not None and not compiled.done():
            self._compiling.append(request_id)
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

        Raises EngineStepError after finishing the step's requests if the model step failed, and its
        KVTransferError (before scheduling) for requests whose prompt K/V could not be pulled.
        """
        start = time.monotonic()
        if self.kv_connector is not None:
            failed = self.scheduler.update_from_kv_connector()
            if failed:
                parents = list(dict.fromkeys(req.parent_id for req, _ in failed))
                for parent in parents:
                    self.groups.pop(parent, None)
                raise KVTransferError(parents, "; ".join(dict.fromkeys(reason for _, reason in failed)))
        failed = self._abort_failed_compiles() if self._compiling else []
        if failed:
            return failed
        batch = self.scheduler.schedule()
        if not batch.requests:
            if self._compiling:  # only compiles are left: wait for one rather than spin
                concurrent.futures.wait([self.groups[g][0].grammar.compiled for g in self._compiling],
                                        timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
            return []
        tables = [self.kv.block_ids(r.request_id) for r in batch.requests]
        try:
            sampled, tokens, logprobs = self.runner.execute(batch, tables)
        except Exception as e:
            logger.exception("engine step failed; failing its %d requests", len(batch.requests))
            parents = list(dict.fromkeys(r.parent_id for r in batch.requests))
            for parent in parents:
                for req in self.groups.pop(parent, []):
                    if not req.is_finished:
                        self.scheduler.finish(req, "abort", uncache=True)
            raise EngineStepError(parents, e) from e
        changed: dict[str, list[Request]] = {}
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            if req.params.max_tokens == 0 and req.num_computed_tokens == req.num_tokens:
                self.scheduler.finish(req, "length")  # a prompt-only request ends after its prefill
                changed.setdefault(req.parent_id, []).append(req)
        for req, new_tokens, new_logprobs in zip(sampled, tokens, logprobs):
            # rejected draft tokens: their K/V slots are simply overwritten by later steps
            req.num_computed_tokens -= len(req.spec_token_ids) + 1 - len(new_tokens)
            if self.speculator is not None:
                self.speculator.observe(req, new_tokens)
            for token, logprob in zip(new_tokens, new_logprobs):
                req.append_token(token, logprob, self.max_model_len)
                self.generation_tokens += 1
                if req.finish_reason is not None:  # tokens after a stop are dropped
                    self.scheduler.finish(req, req.finish_reason)
                    break
            changed.setdefault(req.parent_id, []).append(req)
        if self.speculator is not None:
            self.speculator.propose([r for r in sampled if not r.is_finished], len(self.scheduler.running))
        self.step_log.record(batch, start, self.scheduler.num_preemptions)
        outputs = []
        for parent, reqs in changed.items():
            group = self.groups[parent]
            out = self._output(group, reqs)
            if out.finished:
                del self.groups[parent]
            outputs.append(out)
        return outputs

    def _abort_failed_compiles(self) -> list[RequestOutput]:
        """Aborts the queued groups whose grammar failed to compile; forgets those that compiled."""
        outputs, still = [], []
        for parent in self._compiling:
            group = self.groups.get(parent)
            if group is None:  # aborted meanwhile
                continue
            compiled = group[0].grammar.compiled
            if not compiled.done():
                still.append(parent)
            elif compiled.exception() is not None:
                logger.error("request %s: structured outputs: %s", parent, compiled.exception())
                outputs.append(self.abort_request(parent))
        self._compiling = still
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
        return RequestOutput(first.parent_id, first.prompt, first.prompt_token_ids, completions, finished,
                             max(first.num_cached_tokens, 0), metrics, prompt_logprobs,
                             first.kv_transfer_params if finished else None)

    def stats(self) -> EngineStats:
        s = self.scheduler
        loading = self.kv_connector.num_loading if self.kv_connector else 0  # waiting for their prompt's K/V
        return EngineStats(num_running=len(s.running), num_waiting=len(s.waiting) + loading, kv_cache_usage=self.kv.usage,
                           prefix_cache_queries=self.kv.prefix_cache_queries,
                           prefix_cache_hits=self.kv.prefix_cache_hits, num_preemptions=s.num_preemptions,
                           prompt_tokens=s.num_prompt_tokens, generation_tokens=self.generation_tokens,
                           prompt_tokens_by_source=dict(s.prompt_tokens_by_source),
                           prompt_tokens_recomputed=s.num_prompt_tokens_recomputed,
                           kv_transfer_failures=self.kv_connector.num_failed_transfers if self.kv_connector else 0,
                           kv_expired_requests=self.kv_connector.num_expired_requests if self.kv_connector else 0,
                           spec_decoding=self.speculator.stats.copy() if self.speculator is not None else None)
