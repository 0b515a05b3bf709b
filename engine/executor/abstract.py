"""The executor interface the engine calls, whether the model runs on one rank or on many."""

import os
from abc import ABC, abstractmethod

import torch

from engine.config import EngineConfig
from engine.core.step_io import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from engine.worker.model_runner import ModelRunner


class StepFuture:
    """A step's ModelRunnerOutput, which may still be computing on other ranks (vLLM's execute_model with
    non_block returns a Future). `result()` returns it, waiting if need be, or raises what the step raised.
    Built done (`value` or `error`), or with `wait`, a callable that makes it done."""

    def __init__(self, value: ModelRunnerOutput | None = None, error: BaseException | None = None, wait=None):
        self.value, self.error, self._wait = value, error, wait
        self.done = wait is None

    def set(self, value: ModelRunnerOutput | None = None, error: BaseException | None = None) -> None:
        self.value, self.error, self.done = value, error, True

    def result(self) -> ModelRunnerOutput:
        if not self.done:
            self._wait(self)
        if self.error is not None:
            raise self.error
        return self.value


class Executor(ABC):
    """Runs the model for the engine: `execute_model` once per step.

    runner: rank 0's ModelRunner (its KV cache, dtype, device and limits are the engine's).
    `error` says why no step can run any more (a rank died), None while it can. max_concurrent_batches:
    steps that may be in flight at once (the pipeline's stages; 1 when `execute_model` returns done).
    """

    runner: ModelRunner
    max_concurrent_batches: int = 1

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> StepFuture:
        """Starts one step on every rank; returns its future, whose result is the driver rank's output. Raises
        (or the future raises) whatever the forward raised: the engine fails the step's requests either way."""

    @property
    def error(self) -> str | None:
        return None

    def shutdown(self) -> None:
        """Stops the processes the executor started (idempotent)."""


def default_device(config: EngineConfig) -> torch.device:
    """`config.device`, or CUDA when available, else the CPU."""
    return torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def use_cpu_threads(config: EngineConfig, num_ranks: int) -> None:
    """torch's threads on the CPU: `config.num_threads`, or the cores this process may run on (its affinity:
    `taskset`, a container's cpuset; not every core of the machine) shared out over the ranks."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(config.num_threads or max(1, cores // num_ranks))
