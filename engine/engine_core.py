"""The engine core: the scheduler, the executor and the step's hooks (vLLM v1's EngineCore). Requests come in
from the input processor as scheduler `Request`s; each step's news goes out as EngineCoreOutputs to the
output processor."""

import gc
import logging
import time
from collections import deque

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_cache_spec import MambaSpec
from engine.core.outputs import EngineCoreOutput
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.step_io import SchedulerOutput
from engine.executor import build_executor
from engine.executor.abstract import StepFuture
from engine.kv_transfer.connector import NixlConnector, NoKVConnector
from engine.snapshot import StepLog
from engine.spec_decode.metrics import SpecDecodingLogging
from engine.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """A model step failed; the requests in it (`request_ids`: the engine's request ids) are finished and
    their blocks freed; the engine keeps serving the others."""

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


class EngineCore:
    """Scheduler + KV cache manager + executor, driven by `step()`.

    The features plug in at fixed points of the step, each with a null default: the KV connector before
    scheduling (in the scheduler; NoKVConnector), the structured-outputs hook's grammar masks between
    scheduling and the forward (None when no request is constrained), drafting inside the runner
    (NoSpeculation). `structured`: the engine's StructuredOutputManager (its compile side is the input
    processor's). Raises what building the executor raises (ValueError, OSError, EngineDeadError).
    """

    def __init__(self, config: EngineConfig, hf_config, model_dir: str, structured: StructuredOutputManager):
        self.executor = build_executor(config, hf_config, model_dir)
        runner = self.executor.runner  # rank 0's: the KV cache size and limits are the engine's
        self.max_model_len, self.num_blocks = runner.max_model_len, runner.num_blocks
        # a block table per KV cache group: a sliding-window group frees the blocks that left its window
        specs = tuple(group.kv_cache_spec for group in runner.kv_cache_groups)
        if config.kv_transfer_config is not None and any(spec.sliding_window for spec in specs):
            raise ValueError("kv_transfer_config is not supported for a model with sliding-window layers")
        # recurrent (state) layers: a state slot per running request; their states are not split by blocks
        stateful = any(isinstance(spec, MambaSpec) for spec in specs)
        caching = config.enable_prefix_caching and not stateful
        if stateful:
            unbuilt = [
                name
                for name, on in (
                    ("kv_transfer_config", config.kv_transfer_config),
                    ("speculative_config", config.speculative_config),
                )
                if on
            ]
            if unbuilt:
                raise ValueError(f"{', '.join(unbuilt)} is not supported for a model with recurrent layers")
            if config.enable_prefix_caching:
                logger.info("prefix caching off: this model's recurrent layers keep a state, not blocks")
        self.kv = KVCacheManager(runner.num_blocks, config.block_size, caching, specs, runner.max_num_seqs)
        self.kv_connector = (
            NixlConnector(config.kv_transfer_config, runner.kv_cache, config.block_size)
            if config.kv_transfer_config
            else NoKVConnector()
        )
        spec = config.speculative_config
        k = spec.num_speculative_tokens if spec is not None else 0
        self.scheduler = Scheduler(
            self.kv,
            runner.max_num_seqs,  # config.max_num_seqs, unless recurrent layers' states cap it
            config.max_num_batched_tokens,
            self.max_model_len,
            self.kv_connector,
            num_speculative_tokens=k,
            num_lookahead_tokens=k if spec is not None and spec.method == "draft_model" else 0,
            max_concurrent_batches=self.executor.max_concurrent_batches,
        )
        # steps started and not yet applied, oldest first: (future, SchedulerOutput, start time)
        self.batch_queue: deque[tuple[StepFuture, SchedulerOutput, float]] = deque()
        self.structured = structured
        stats = self.scheduler.spec_decoding_stats
        self.spec_logging = SpecDecodingLogging(stats) if stats is not None else None
        self.step_log = StepLog()  # recent steps, for the dashboard
        # The start-up heap (the model, its weights' Python objects, the tokenizer) out of the cyclic collector's way:
        # collections then traverse only what requests allocate (vLLM's freeze_gc_heap). A batch-1 decode step at
        # depth 4,000 spent ~5% of its time in gc_collect_main; 7.70 -> 7.35 and 7.11 -> 6.65 ms median, alternating.
        # Unfrozen first: an engine dropped earlier in this process (tests, scripts) is collected now, not kept.
        gc.unfreeze()
        gc.collect()
        gc.freeze()

    def add_request(self, request: Request) -> None:
        self.kv_connector.check_request(request.kv_transfer_params, request.num_prompt_tokens, 1)
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids, reason: str) -> None:
        """Finishes these requests now ("abort", or "stop" for a stop string) and frees their blocks."""
        self.scheduler.finish_requests(request_ids, reason)
        self.step_log.record_finished(self.scheduler.pop_finished())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.batch_queue)

    def step(self) -> list[EngineCoreOutput]:
        """Schedules and starts a step, and applies the oldest step in flight; returns the news of every
        request that changed (vLLM v1's step_with_batch_queue; with one step at a time, the step it starts).

        While fewer than the executor's max_concurrent_batches steps are in flight and something could be
        scheduled, it returns at once with no news (the caller steps again); otherwise it waits for the
        oldest step's output. Raises KVTransferError (before scheduling) for requests whose prompt K/V could
        not be pulled, and EngineStepError after finishing a step's requests (their blocks uncached) if its
        model step failed.
        """
        start = time.monotonic()
        failed = self.scheduler.update_from_kv_connector()
        if failed:
            self.step_log.record_finished(self.scheduler.pop_finished())
            raise KVTransferError(
                [req.request_id for req, _ in failed], "; ".join(dict.fromkeys(reason for _, reason in failed))
            )
        if len(self.batch_queue) < self.executor.max_concurrent_batches:
            scheduler_output = self.scheduler.schedule()
            # an empty step still goes out when the workers can forget finished requests
            if scheduler_output.num_scheduled_tokens or scheduler_output.finished_req_ids:
                grammar_output = (
                    self.structured.grammar_bitmask(self.scheduler.requests, scheduler_output)
                    if scheduler_output.num_scheduled_tokens
                    else None
                )
                try:
                    future = self.executor.execute_model(scheduler_output, grammar_output)
                except Exception as e:  # failed before it could start: failed like a step that ran
                    future = StepFuture(error=e)
                self.batch_queue.append((future, scheduler_output, start))
                if (
                    scheduler_output.num_scheduled_tokens
                    and len(self.batch_queue) < self.executor.max_concurrent_batches
                ):
                    return []
        if not self.batch_queue:
            return []
        future, scheduler_output, start = self.batch_queue.popleft()
        try:
            runner_output = future.result()
        except Exception as e:
            ids = list(scheduler_output.num_scheduled_tokens)
            logger.exception("engine step failed; failing its %d requests", len(ids))
            self.scheduler.finish_requests(ids, "abort", uncache=True)
            # the workers may not have seen this step: tell them its finished requests again with the next
            self.scheduler.finished_req_ids_unsent(scheduler_output.finished_req_ids)
            self.step_log.record_finished(self.scheduler.pop_finished())
            raise EngineStepError(ids, e) from e
        if not scheduler_output.num_scheduled_tokens:
            return []
        self.step_log.record(scheduler_output, self.scheduler.requests, start, self.scheduler.num_preemptions)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.step_log.record_finished(self.scheduler.pop_finished())
        if self.spec_logging is not None:
            self.spec_logging.maybe_log()
        return outputs

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block hash (benchmarks repeating prompts; vLLM's name)."""
        self.kv.pool.uncache(self.kv.pool.blocks)

    def shutdown(self) -> None:
        """Stops the KV connector and the executor's processes; the heap frozen at start-up goes back to the
        collector."""
        self.kv_connector.close()
        self.executor.shutdown()
        gc.unfreeze()
