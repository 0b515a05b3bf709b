"""Executors: what runs the model for the engine. `abstract.Executor` is the one interface;
`uniproc.UniProcExecutor` runs it in the engine's process, `multiproc.MultiprocExecutor` over the ranks of
tensor and pipeline parallelism, rank 0 in the engine's process and the others in `worker_proc` processes
(vLLM v1's vllm/v1/executor)."""


def build_executor(config, hf_config, model_dir: str):
    """The executor (`abstract.Executor`) for `config.world_size` ranks; imported here, on use, so that
    importing the package stays light. Raises what the executor raises."""
    if config.world_size == 1:
        from engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, hf_config, model_dir)
    from engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, hf_config, model_dir)
