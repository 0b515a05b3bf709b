"""A tensor-parallel rank other than 0 (`python -m engine.executor.tp_worker`, started by launcher.py):
loads its shard of the model and the KV cache of its heads, then runs the forward pass of every step
rank 0 broadcasts, until rank 0 says stop."""
import argparse
import logging
import os
import pickle
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.distributed.group import EngineDeadError, TPGroup
from engine.executor.tensor_parallel import START_TIMEOUT, build_rank_runner, rank_device
from models.loader import load_config
from engine.worker.input_batch import ModelInputs

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    """Runs one rank. Returns 0 after rank 0's stop message, 1 when rank 0 is gone or a collective
    failed (other errors propagate, with their traceback in the log)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="rank 0's TCPStore on 127.0.0.1")
    p.add_argument("--device-type", choices=["cpu", "cuda"], required=True)
    p.add_argument("--model-dir", required=True)
    args = p.parse_args(argv)
    # Ctrl-C reaches the whole process group; rank 0 decides when the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s")
    device = rank_device(args.device_type, args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", args.port, args.world_size, False, timeout=timedelta(seconds=START_TIMEOUT))
    store.set(f"rank{args.rank}", "ready")
    try:
        group = TPGroup(store, args.rank, args.world_size, device)
        config = pickle.loads(store.get("engine_config"))  # rank 0's EngineConfig
        runner = build_rank_runner(config, load_config(args.model_dir), args.model_dir, group)
        while (step := group.recv_step()) is not None:
            runner.forward(ModelInputs(*step))
    except EngineDeadError as e:
        logger.error("stopping: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    status = main()
    # A rank has nothing to flush, and tearing down torch's interpreter state takes seconds.
    logging.shutdown()
    os._exit(status)
