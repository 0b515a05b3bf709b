"""Rank 0's side of tensor and pipeline parallelism: the executor, and the other ranks' processes (start,
watch, stop).

There are tensor_parallel_size x pipeline_parallel_size ranks; rank r is tensor-parallel rank r % T of
pipeline stage r // T (models/distributed/group.py). Rank 0 is the engine's own process (it runs the
scheduler and its part of the model; without pipeline stages also the sampler); ranks 1..N-1 are
`python -m engine.executor.worker_proc` processes that only run their part (the first rank of the last
stage also samples), started with torchrun's semantics: rank, world size and the address of the
rendezvous (a TCPStore that rank 0 serves, holding the engine config) on the command line. Unlike
multiprocessing's "spawn", this never re-imports the caller's main module, so a script needs no
`if __name__ == "__main__"` guard.

On one host rank 0 starts every rank and the rendezvous is on 127.0.0.1. Across hosts (vLLM's
`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`) each host runs world size / nnodes
consecutive ranks (one pipeline stage per host when nnodes is the number of stages): node 0 runs the
server with rank 0 and starts its own others; every other node runs `server.py --headless`, which starts
its ranks (`run_headless`), and they join rank 0's rendezvous at the master address.

A rank that exits (killed, crashed, out of memory) is seen at once by a watchdog thread waiting on
it: the thread records the error, logs it and kills the other ranks, so any collective rank 0 is in
fails at once (their sockets close) and every later step raises EngineDeadError; the server polls
the group's `error` and shuts down (api/cli.py). Ranks on other hosts cannot be waited on: they send
rank 0 a heartbeat through the rendezvous store every second, and one silent for HEARTBEAT_TIMEOUT
(host down, network cut) fails the engine the same way; a rank that cannot reach rank 0 for as long
exits. A step already inside a collective with a cut-off host waits out `distributed_timeout_seconds`.
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
from collections import deque
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.core.step_io import GrammarOutput, SchedulerOutput
from engine.executor.abstract import Executor, StepFuture, default_device, use_cpu_threads
from engine.worker.model_runner import ModelRunner
from models.config import ModelShape
from models.distributed.group import COLLECTIVE_TIMEOUT, EngineDeadError, ParallelGroup
from models.distributed.pipeline import get_pp_indices
from models.loader import resolve_model

logger = logging.getLogger(__name__)

START_TIMEOUT = 600  # seconds for the other ranks to import torch and reach the rendezvous
DEFAULT_MASTER_PORT = 29501  # vLLM's, for ranks on several hosts (one host uses a free port)
HEARTBEAT_INTERVAL = 1.0  # seconds between the heartbeats of a rank on another host
HEARTBEAT_TIMEOUT = 10.0  # seconds without one (either way) before that rank or rank 0 counts as gone


def node_ranks(config: EngineConfig, node_rank: int) -> range:
    """The ranks that run on node `node_rank`: world_size / nnodes consecutive ones."""
    per_node = config.world_size // config.nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def rank_name(config: EngineConfig, rank: int) -> str:
    """How logs and errors name a rank: "tensor-parallel rank r" without pipeline stages, else
    "rank r (pipeline stage s)"."""
    if config.pipeline_parallel_size == 1:
        return f"tensor-parallel rank {rank}"
    return f"rank {rank} (pipeline stage {rank // config.tensor_parallel_size})"


def collective_timeout(config: EngineConfig) -> timedelta:
    return (
        timedelta(seconds=config.distributed_timeout_seconds)
        if config.distributed_timeout_seconds
        else COLLECTIVE_TIMEOUT
    )


def master_port(config: EngineConfig) -> int:
    """The rendezvous port: the configured one, else a free one (0) on one host, else vLLM's default."""
    if config.master_port is not None:
        return config.master_port
    return 0 if config.nnodes == 1 else DEFAULT_MASTER_PORT


def start_rank(rank: int, config: EngineConfig, port: int, model_dir: str, device_type: str) -> subprocess.Popen:
    """Starts rank `rank` (> 0) as a `tp_worker` process that joins the rendezvous at master_addr:port."""
    # the ranks import this very copy of the package, whatever their working directory
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.executor.worker_proc",
            "--rank",
            str(rank),
            "--world-size",
            str(config.world_size),
            "--master-addr",
            config.master_addr,
            "--port",
            str(port),
            "--device-type",
            device_type,
            "--model-dir",
            model_dir,
        ],
        env=env,
    )


class MultiprocExecutor(Executor):
    """Rank 0 of `config.world_size` ranks, after starting the others (which load their parts at the same
    time): each step rank 0 sends the step's description (the SchedulerOutput and the grammar masks) to the
    others, and every rank's runner updates its own requests, builds its inputs and runs its part; the
    driver (the first rank of the last stage) samples. Without pipeline stages rank 0 is the driver and a
    step is done when `execute_model` returns. With P stages rank 0 runs the first and returns the step's
    future at once, so the engine can start the next (`max_concurrent_batches` = P); the driver sends each
    step's output back in order, and a future's `result()` receives the outputs up to its own. No CUDA
    graphs (the collectives would have to be captured).

    Raises ValueError when the model's heads do not split over the tensor-parallel ranks or its layers over
    the stages (before starting any rank), or when CUDA has fewer GPUs than ranks, and EngineDeadError when
    a rank fails to start.
    """

    def __init__(self, config: EngineConfig, hf_config, model_dir: str):
        world = config.world_size
        ModelShape.from_hf(hf_config, config.tensor_parallel_size)
        get_pp_indices(hf_config.num_hidden_layers, 0, config.pipeline_parallel_size, config.layer_partition)
        device = default_device(config)
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"{world} ranks need {world} GPUs; {torch.cuda.device_count()} visible")
        if config.node_rank != 0:
            raise ValueError(f"node_rank {config.node_rank} runs no engine: start it with run_headless")
        self.workers = Workers(config, model_dir, device.type)
        self.group = self.workers.group
        self.max_concurrent_batches = config.pipeline_parallel_size
        self._in_flight: deque[StepFuture] = deque()  # futures of the steps whose output has not come back
        try:
            self.runner = build_rank_runner(config, hf_config, model_dir, self.group)
        except BaseException:
            self.workers.shutdown()
            raise

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> StepFuture:
        self.group.send_step((scheduler_output, grammar_output))
        output = self.runner.execute_model(scheduler_output, grammar_output)
        if self.group.pp_size == 1:
            return StepFuture(output)
        future = StepFuture(wait=self._receive_until)
        self._in_flight.append(future)
        return future

    def _receive_until(self, future: StepFuture) -> None:
        """Receives the driver's outputs, oldest step first, until `future`'s has come."""
        while not future.done:
            oldest = self._in_flight.popleft()
            try:
                oldest.set(self.group.recv_output())
            except EngineDeadError as e:
                oldest.set(error=e)

    @property
    def error(self) -> str | None:
        return self.group.error

    def shutdown(self) -> None:
        """Takes the outputs of the steps still in flight (so the driver's sends complete), then stops the
        other ranks and closes the group."""
        while self._in_flight and self.group.error is None:
            self._receive_until(self._in_flight[-1])
        self.workers.shutdown()
        self.group.close()


def build_rank_runner(config: EngineConfig, hf_config, model_dir: str, group: ParallelGroup) -> ModelRunner:
    """One rank's ModelRunner (every rank builds its own the same way): its part of the model, and as many
    KV blocks as the rank with the least room holds (a collective: all ranks call it)."""
    if group.device.type == "cpu":  # the ranks of a host share its cores
        use_cpu_threads(config, group.world_size // config.nnodes)
    runner = ModelRunner(config, hf_config, model_dir, group.device, group)
    # the ranks share the machine's memory: kv_cache_memory is for all of them
    runner.init_kv_cache(
        group.min(runner.available_kv_blocks(config.kv_cache_memory // group.world_size)), cuda_graphs=False
    )
    return runner


def rank_device(device_type: str, rank: int) -> torch.device:
    """Rank r runs on GPU r on CUDA; every rank on the CPU otherwise."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


class Workers:
    """The processes of ranks 1..N-1 on this host, the heartbeats of those on other hosts, and rank
    0's ParallelGroup (`group`; its `error` says why the engine died).

    Stopped by `shutdown()` (also at interpreter exit): the stop message, then SIGKILL for any rank
    of this host still running 10 s later.
    """

    def __init__(self, config: EngineConfig, model_dir: str, device_type: str):
        world = config.world_size
        store = dist.TCPStore(
            config.master_addr,
            master_port(config),
            world,
            True,
            timeout=timedelta(seconds=START_TIMEOUT),
            wait_for_workers=False,
        )
        store.set("engine_config", pickle.dumps(config))  # whatever fields it grows
        self.group: ParallelGroup | None = None
        self.death: str | None = None  # which rank exited, as the watchdog saw it
        self._died = threading.Event()
        self._stopping = False
        self.procs: list[subprocess.Popen] = []
        self._heartbeats: threading.Thread | None = None
        atexit.register(self.shutdown)
        remote = [rank for rank in range(world) if rank not in node_ranks(config, 0)]
        try:
            for rank in node_ranks(config, 0)[1:]:
                self.procs.append(start_rank(rank, config, store.port, model_dir, device_type))
                logger.info("%s of %d: pid %d", rank_name(config, rank), world, self.procs[-1].pid)
            for rank, proc in enumerate(self.procs, 1):
                threading.Thread(
                    target=self._watch, args=(rank_name(config, rank), proc), name=f"rank-watch-{rank}", daemon=True
                ).start()
            self._wait_for_ranks(store, config)
            for rank in remote:
                logger.info("%s of %d: on %s", rank_name(config, rank), world, store.get(f"host{rank}").decode())
            group = ParallelGroup(
                store,
                0,
                world,
                rank_device(device_type, 0),
                config.master_addr,
                collective_timeout(config),
                config.tensor_parallel_size,
            )
        except BaseException:
            self.shutdown()
            raise
        group.workers = self
        self.group = group
        group.error = group.error or self.death  # a rank that died just now
        if remote:
            self._heartbeats = threading.Thread(
                target=self._watch_heartbeats, args=(config, store.port, remote), name="tp-heartbeats", daemon=True
            )
            self._heartbeats.start()

    def _wait_for_ranks(self, store: dist.TCPStore, config: EngineConfig) -> None:
        """Waits until every rank has reached the rendezvous, failing at once if one of this host's
        exits first (the process group's own rendezvous would wait out its whole timeout)."""
        keys = [f"rank{rank}" for rank in range(1, config.world_size)]
        deadline = time.monotonic() + START_TIMEOUT
        while not store.check(keys):
            if self.death is not None:
                raise EngineDeadError(f"{self.death} before joining the process group")
            if time.monotonic() > deadline:
                missing = [n for n in range(1, config.nnodes) if not store.check([f"rank{node_ranks(config, n)[0]}"])]
                raise EngineDeadError(
                    f"the other ranks did not start within {START_TIMEOUT} s"
                    + (
                        f"; nodes {missing} never joined {config.master_addr}:{store.port} (start "
                        f"`server.py --headless --nnodes {config.nnodes} --node-rank N --master-addr "
                        f"{config.master_addr} --master-port {store.port}` there)"
                        if missing
                        else ""
                    )
                )
            time.sleep(0.05)

    def _watch_heartbeats(self, config: EngineConfig, port: int, ranks: list[int]) -> None:
        """Fails the engine when a rank on another host has sent no heartbeat for HEARTBEAT_TIMEOUT.
        Ends soon after `_stopping` is set (shutdown joins it: a thread in the store's C++ at interpreter
        exit aborts the process)."""
        store = dist.TCPStore(
            config.master_addr, port, config.world_size, False, timeout=timedelta(seconds=HEARTBEAT_TIMEOUT)
        )
        seen = {rank: (-1, time.monotonic()) for rank in ranks}  # last count, when it changed
        while not self._stopping:
            time.sleep(HEARTBEAT_INTERVAL)
            for rank in ranks:
                count, now = store.add(f"heartbeat{rank}", 0), time.monotonic()
                if count != seen[rank][0]:
                    seen[rank] = (count, now)
                elif now - seen[rank][1] > HEARTBEAT_TIMEOUT and not self._stopping:
                    host = store.get(f"host{rank}").decode()
                    self._fail(
                        f"{rank_name(config, rank)} on {host} sent no heartbeat for "
                        f"{HEARTBEAT_TIMEOUT:g} s (host down or cut off)"
                    )
                    return

    def _watch(self, name: str, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping:
            return
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        self._fail(f"{name} (pid {proc.pid}) {how}")

    def _fail(self, death: str) -> None:
        """A rank is gone: records why, stops this host's ranks and fails the group."""
        self.death = death
        logger.error("%s; stopping the other ranks: the engine cannot run any more", death)
        self._kill()  # first, so that whoever sees the error finds every rank stopped
        if self.group is not None:
            self.group.error = self.group.error or death
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
        """Stops the other ranks (idempotent): the stop message, then SIGKILL after 10 s for this host's."""
        atexit.unregister(self.shutdown)
        if not self._stopping:
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
        if self._heartbeats is not None and self._heartbeats is not threading.current_thread():
            self._heartbeats.join()


def run_headless(config: EngineConfig) -> int:
    """A node other than node 0 (`server.py --headless`): starts this node's ranks, which join rank 0's
    rendezvous at master_addr:master_port (waiting up to START_TIMEOUT for it to start) and run every
    step until rank 0 stops them. SIGTERM or SIGINT stops them. Returns 0 when every rank ended
    cleanly, else 1 (a rank failed, or lost rank 0)."""
    model_dir, port = resolve_model(config.model), master_port(config)
    device_type = default_device(config).type
    procs = {
        rank: start_rank(rank, config, port, model_dir, device_type) for rank in node_ranks(config, config.node_rank)
    }
    for rank, proc in procs.items():
        logger.info(
            "%s of %d: pid %d, joining %s:%d",
            rank_name(config, rank),
            config.world_size,
            proc.pid,
            config.master_addr,
            port,
        )

    def stop(*_) -> None:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    codes = {rank: proc.wait() for rank, proc in procs.items()}
    for rank, code in codes.items():
        if code != 0:
            logger.error("%s exited with status %d", rank_name(config, rank), code)
    return 0 if not any(codes.values()) else 1
