"""A rank other than 0 (`python -m engine.executor.worker_proc`, started by multiproc.py on rank 0's host
or by a headless node): loads its part of the model (its pipeline stage's layers, of each its tensor-parallel
shard) and the KV cache of those, then runs every step rank 0 sends (its own copy of the requests updated
from the SchedulerOutput, its own inputs, its part's forward; the driver, the first rank of the last stage,
sends the step's output back to rank 0) until rank 0 says stop.
A rank on another host than rank 0's sends it a heartbeat every second and exits when rank 0 has not
answered one for HEARTBEAT_TIMEOUT."""

import argparse
import gc
import logging
import os
import pickle
import signal
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.executor.multiproc import (
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    START_TIMEOUT,
    build_rank_runner,
    collective_timeout,
    node_ranks,
    rank_device,
)
from models.distributed.group import EngineDeadError, ParallelGroup, local_address
from models.loader import load_config

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    """Runs one rank. Returns 0 after rank 0's stop message, 1 when rank 0 is gone or a collective
    failed (other errors propagate, with their traceback in the log)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1", help="rank 0's host")
    p.add_argument("--port", type=int, required=True, help="rank 0's TCPStore there")
    p.add_argument("--device-type", choices=["cpu", "cuda"], required=True)
    p.add_argument("--model-dir", required=True)
    args = p.parse_args(argv)
    # Ctrl-C reaches the whole process group; rank 0 decides when the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s"
    )
    device = rank_device(args.device_type, args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(args.master_addr, args.port, args.world_size, False, timeout=timedelta(seconds=START_TIMEOUT))
    config = pickle.loads(store.get("engine_config"))  # rank 0's EngineConfig
    if config.world_size != args.world_size:
        logger.error(
            "rank 0 at %s runs %d ranks (tensor x pipeline parallel), this rank was started for %d",
            args.master_addr,
            config.world_size,
            args.world_size,
        )
        return 1
    store.set(f"host{args.rank}", local_address(args.master_addr))
    if args.rank not in node_ranks(config, 0):  # rank 0 cannot see this process: it hears from it instead
        threading.Thread(target=heartbeat, args=(args,), name="heartbeat", daemon=True).start()
    store.set(f"rank{args.rank}", "ready")
    try:
        group = ParallelGroup(
            store,
            args.rank,
            args.world_size,
            device,
            args.master_addr,
            collective_timeout(config),
            config.tensor_parallel_size,
        )
        runner = build_rank_runner(config, load_config(args.model_dir), args.model_dir, group)
        gc.collect()  # the start-up heap out of the cyclic collector's way, as EngineCore does
        gc.freeze()
        while (step := group.recv_step()) is not None:
            output = runner.execute_model(*step)
            if output is not None:  # the driver of a pipeline (rank 0 drives without stages)
                group.send_output(output)
        group.flush()  # the stop message on to the next stage
    except EngineDeadError as e:
        logger.error("stopping: %s", e)
        return 1
    return 0


def heartbeat(args: argparse.Namespace) -> None:
    """Counts this rank's heartbeats up in rank 0's store every HEARTBEAT_INTERVAL, and exits the process
    with status 1 once none has gone through for HEARTBEAT_TIMEOUT: rank 0's host is down or cut off,
    and the step loop would otherwise wait for its next step for ever."""
    store = dist.TCPStore(
        args.master_addr, args.port, args.world_size, False, timeout=timedelta(seconds=HEARTBEAT_TIMEOUT)
    )
    last_beat = time.monotonic()

    def beat() -> None:
        nonlocal last_beat
        while True:
            try:
                store.add(f"heartbeat{args.rank}", 1)  # blocks for ever on a cut link, hence the watch below
            except RuntimeError:  # DistStoreError: rank 0's store is gone
                return
            last_beat = time.monotonic()
            time.sleep(HEARTBEAT_INTERVAL)

    threading.Thread(target=beat, name="heartbeat-send", daemon=True).start()
    while time.monotonic() - last_beat < HEARTBEAT_TIMEOUT:
        time.sleep(HEARTBEAT_INTERVAL)
    logger.error(
        "stopping: rank 0 at %s:%d has not answered for %g s (host down or cut off)",
        args.master_addr,
        args.port,
        HEARTBEAT_TIMEOUT,
    )
    logging.shutdown()
    os._exit(1)


if __name__ == "__main__":
    status = main()
    # A rank has nothing to flush, and tearing down torch's interpreter state takes seconds.
    logging.shutdown()
    os._exit(status)
