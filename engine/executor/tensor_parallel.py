"""Rank 0's side of tensor parallelism: the executor, and the other ranks' processes (start, watch, stop).

Rank 0 is the engine's own process (it runs the scheduler, its model shard and the sampler); ranks
1..N-1 are `python -m engine.executor.tp_worker` processes that only run their model shard, started
with torchrun's semantics: rank, world size and the address of the rendezvous (a TCPStore that rank
0 serves on a free 127.0.0.1 port, holding the engine config) on the command line. Unlike
multiprocessing's "spawn", this never re-imports the caller's main module, so a script needs no
`if __name__ == "__main__"` guard.

A rank that exits (killed, crashed, out of memory) is seen at once by a watchdog thread waiting on
it: the thread records the error, logs it and kills the other ranks, so any collective rank 0 is in
fails at once (their sockets close) and every later step raises EngineDeadError; the server polls
the group's `error` and shuts down (api/cli.py).
"""
import atexit
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.core.step_io import ModelRunnerOutput, SchedulerOutput
from engine.distributed.group import EngineDeadError, TPGroup
from engine.executor.abstract import Executor, default_device, use_cpu_threads
from engine.worker.input_batch import prepare_inputs
from engine.worker.model_runner import ModelRunner
from models.config import ModelShape

logger = logging.getLogger(__name__)

START_TIMEOUT = 600  # seconds for the other ranks to import torch and reach the rendezvous


class TensorParallelExecutor(Executor):
    """Rank 0 of `config.tensor_parallel_size` ranks, after starting the others (which load their
    shards at the same time): each step rank 0 prepares the inputs, broadcasts them, runs its shard
    with the others and samples alone. No CUDA graphs (the collectives would have to be captured) and
    no prompt logprobs (rank 0 alone would compute their extra logits, which every rank must).

    Raises ValueError when the model's heads do not split over the ranks (before starting any),
    or when CUDA has fewer GPUs than ranks, and EngineDeadError when a rank fails to start.
    """

    supports_prompt_logprobs = False

    def __init__(self, config: EngineConfig, hf_config, model_dir: str):
        world = config.tensor_parallel_size
        ModelShape.from_hf(hf_config, world)
        device = default_device(config)
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs; {torch.cuda.device_count()} visible")
        self.workers = Workers(config, model_dir, device.type)
        self.group = self.workers.group
        try:
            self.runner = build_rank_runner(config, hf_config, model_dir, self.group)
        except BaseException:
            self.workers.shutdown()
            raise

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        batch = prepare_inputs(scheduler_output, self.runner.block_size, self.runner.device)
        inputs = batch.model_inputs
        self.group.broadcast_step(inputs.input_ids, inputs.positions, inputs.attn_metadata, inputs.logits_indices)
        return self.runner.sample(scheduler_output, batch, self.runner.forward(inputs, batch))

    @property
    def error(self) -> str | None:
        return self.group.error

    def shutdown(self) -> None:
        self.workers.shutdown()
        self.group.close()


def build_rank_runner(config: EngineConfig, hf_config, model_dir: str, group: TPGroup) -> ModelRunner:
    """One rank's ModelRunner (every rank builds its own the same way): its shard of the model, and
    as many KV blocks as the rank with the least room holds (a collective: all ranks call it)."""
    if group.device.type == "cpu":  # the ranks share the cores
        use_cpu_threads(config, group.world_size)
    runner = ModelRunner(config, hf_config, model_dir, group.device, group)
    # the ranks share the machine's memory: kv_cache_memory is for all of them
    runner.init_kv_cache(group.min(runner.available_kv_blocks(config.kv_cache_memory // group.world_size)),
                         cuda_graphs=False)
    return runner


def rank_device(device_type: str, rank: int) -> torch.device:
    """Rank r runs on GPU r on CUDA; every rank on the CPU otherwise."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


class Workers:
    """The processes of ranks 1..N-1, and rank 0's TPGroup (`group`; its `error` says why the engine died).

    Stopped by `shutdown()` (also at interpreter exit): the stop message, then SIGKILL for any rank
    still running 10 s later.
    """

    def __init__(self, config: EngineConfig, model_dir: str, device_type: str):
        world = config.tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=START_TIMEOUT),
                              wait_for_workers=False)
        store.set("engine_config", pickle.dumps(config))  # whatever fields it grows
        # the ranks import this very copy of the package, whatever their working directory
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        args = ["--world-size", str(world), "--port", str(store.port), "--device-type", device_type,
                "--model-dir", model_dir]
        self.group: TPGroup | None = None
        self.death: str | None = None  # which rank exited, as the watchdog saw it
        self._died = threading.Event()
        self._stopping = False
        self.procs: list[subprocess.Popen] = []
        atexit.register(self.shutdown)
        try:
            for rank in range(1, world):
                self.procs.append(subprocess.Popen([sys.executable, "-m", "engine.executor.tp_worker",
                                                    "--rank", str(rank), *args], env=env))
                logger.info("tensor-parallel rank %d of %d: pid %d", rank, world, self.procs[-1].pid)
            for rank, proc in enumerate(self.procs, 1):
                threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-watch-{rank}", daemon=True).start()
            self._wait_for_ranks(store, world)
            group = TPGroup(store, 0, world, rank_device(device_type, 0))
        except BaseException:
            self.shutdown()
            raise
        group.workers = self
        self.group = group
        group.error = group.error or self.death  # a rank that died just now

    def _wait_for_ranks(self, store: dist.TCPStore, world: int) -> None:
        """Waits until every rank has reached the rendezvous, failing at once if one exits first (the
        process group's own rendezvous would wait out its whole timeout)."""
        keys = [f"rank{rank}" for rank in range(1, world)]
        deadline = time.monotonic() + START_TIMEOUT
        while not store.check(keys):
            if self.death is not None:
                raise EngineDeadError(f"{self.death} before joining the process group")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"tensor-parallel ranks did not start within {START_TIMEOUT} s")
            time.sleep(0.05)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping:
            return
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        self.death = f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"
        logger.error("%s; stopping the other ranks: the engine cannot run any more", self.death)
        self._kill()  # first, so that whoever sees the error finds every rank stopped
        if self.group is not None:
            self.group.error = self.group.error or self.death
            self.group.abort()
        self._died.set()

    def on_collective_failure(self) -> str | None:
        """Rank 0's collective failed: gives the watchdog a moment to name a rank that died (its
        sockets close before its exit is seen), kills every rank, and returns the watchdog's message
        (None if no rank died, e.g. after a timeout)."""
        self._died.wait(5)
        self._kill()
        return self.death

    def _kill(self) -> None:
        self._stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()

    def shutdown(self) -> None:
        """Stops the other ranks (idempotent): the stop message, then SIGKILL after 10 s."""
        atexit.unregister(self.shutdown)
        if self._stopping:
            return
        self._stopping = True
        if self.group is not None and self.group.error is None and all(p.poll() is None for p in self.procs):
            try:
                self.group.stop()
                for proc in self.procs:
                    proc.wait(10)
            except (EngineDeadError, subprocess.TimeoutExpired):
                pass  # the ones left are killed below
            self.group.error = "the engine was shut down"
        self._kill()
