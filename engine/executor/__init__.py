"""Executors: what runs the model for the engine. `abstract.Executor` is the one interface;
`uniproc.UniProcExecutor` runs it in the engine's process, `tensor_parallel.TensorParallelExecutor`
over N ranks, rank 0 in the engine's process and the others in `tp_worker` processes (vLLM v1's
vllm/v1/executor)."""


def build_executor(config, hf_config, model_dir: str):
    """The executor (`abstract.Executor`) for `config.tensor_parallel_size` ranks; imported here, on use,
    so that importing the package stays light. Raises what the executor raises."""
    if config.tensor_parallel_size == 1:
        from engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, hf_config, model_dir)
    from engine.executor.tensor_parallel import TensorParallelExecutor

    return TensorParallelExecutor(config, hf_config, model_dir)
