"""The model on one device, in the engine's own process."""

from engine.config import EngineConfig
from engine.core.step_io import GrammarOutput, SchedulerOutput
from engine.executor.abstract import Executor, StepFuture, default_device, use_cpu_threads
from engine.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    """One ModelRunner with the whole KV budget; CUDA graphs unless `enforce_eager`."""

    def __init__(self, config: EngineConfig, hf_config, model_dir: str):
        device = default_device(config)
        if device.type == "cpu":
            use_cpu_threads(config, 1)
        self.runner = ModelRunner(config, hf_config, model_dir, device)
        self.runner.init_kv_cache(
            self.runner.available_kv_blocks(config.kv_cache_memory), cuda_graphs=not config.enforce_eager
        )

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> StepFuture:
        return StepFuture(self.runner.execute_model(scheduler_output, grammar_output))
