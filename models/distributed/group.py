"""One engine's tensor-parallel process group: the collectives of the model shards and the per-step
broadcast of the step's description from rank 0 (which runs the scheduler) to the other ranks, each of
which builds its own inputs from it.

The process groups are built directly on a TCPStore rather than through `init_process_group`, so
they are not the process's global default group: a process (a test session, a notebook) can hold
several engines, each with its own group. Every collective has a timeout; a failed one marks the
group dead (`error`), and every later call raises EngineDeadError at once.
"""

import os
import pickle
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

# A rank alive but stuck this long inside a collective fails the engine (a dead rank fails it at once:
# its sockets close; a host cut off does not). Long, because one step of a big prefill on one thread
# can take many seconds. --distributed-timeout-seconds changes it.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# The other ranks wait for rank 0's next step as long as the engine idles.
IDLE_TIMEOUT = timedelta(days=365)


def local_address(peer: str) -> str:
    """This host's address on the route to `peer` (an IP address or host name): where gloo listens, so
    that the other ranks can reach it. No packet is sent (a UDP socket only picks its route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


def gloo_device(master_addr: str):
    """Gloo's transport bound to the interface GLOO_SOCKET_IFNAME names (as torch.distributed honours
    it), else to this host's address toward rank 0's: gloo's default, the address the host name
    resolves to, is often loopback or missing on a multi-host cluster."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo.create_device(interface=os.environ["GLOO_SOCKET_IFNAME"].split(",")[0])
    return dist.ProcessGroupGloo.create_device(hostname=local_address(master_addr))


class EngineDeadError(RuntimeError):
    """A tensor-parallel rank died, or a collective failed or timed out: the engine cannot run again."""


class TPGroup:
    """The ranks of one tensor-parallel engine, seen from one rank.

    rank, world_size: this rank and the number of ranks. device: this rank's device (cuda:rank on CUDA).
    master_addr: rank 0's address (gloo listens on this host's address toward it; gloo_device).
    timeout: how long every collective but the idle wait for a step may take (a timedelta).
    Tensors of the model go through `device_group` (gloo on CPU, NCCL on CUDA); the step headers and
    the start-up agreement go through `cpu_group` (gloo). `error` is None while the group works, else
    why it stopped; on rank 0 `workers` (set by the launcher) names a dead rank and stops the others.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        device: torch.device,
        master_addr: str,
        timeout: timedelta = COLLECTIVE_TIMEOUT,
    ):
        self.rank, self.world_size, self.device = rank, world_size, device
        gloo = dist.ProcessGroupGloo._Options()
        gloo._devices = [gloo_device(master_addr)]
        gloo._timeout = timeout
        self.cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world_size, gloo)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.device_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size, options)
        else:
            self.device_group = self.cpu_group
        self.error: str | None = None
        self.workers = None
        self._open_groups = list({id(g): g for g in (self.device_group, self.cpu_group)}.values())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x (any shape and dtype, on `device`) over the ranks, in place; returns x."""
        self._run(self.device_group.allreduce, [x])
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenates every rank's x [N, D] (rank order) along the last dim: [N, world_size * D] on
        rank 0, None on the others (rank 0 alone samples, so the others need no logits)."""
        if self.rank != 0:
            self._run(self.device_group.gather, [], [x])
            return None
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._run(self.device_group.gather, [parts], [x])
        return torch.cat(parts, dim=-1)

    def min(self, value: int) -> int:
        """The smallest of every rank's `value` (ranks agree on a KV-cache size at start-up)."""
        t = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._run(self.cpu_group.allreduce, [t], options)
        return int(t.item())

    def send_step(self, step) -> None:
        """Rank 0: sends one step's description (a picklable object: the executor sends the SchedulerOutput
        and the grammar masks) to the other ranks: its size over gloo, then its pickled bytes."""
        payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        self._run(self.cpu_group.broadcast, torch.tensor([len(payload)], dtype=torch.int64), 0)
        self._run(self.cpu_group.broadcast, torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0)

    def recv_step(self):
        """Other ranks: waits for rank 0's next step; returns what rank 0 passed to `send_step`, or None
        after `stop`. Raises EngineDeadError when rank 0 is gone."""
        header = torch.empty(1, dtype=torch.int64)
        self._run(self.cpu_group.broadcast, header, 0, IDLE_TIMEOUT)
        size = int(header.item())
        if size < 0:
            return None
        payload = torch.empty(size, dtype=torch.uint8)
        self._run(self.cpu_group.broadcast, payload, 0)
        return pickle.loads(payload.numpy().tobytes())

    def stop(self) -> None:
        """Rank 0: tells the other ranks to leave their step loop (they exit with status 0)."""
        self._run(self.cpu_group.broadcast, torch.tensor([-1], dtype=torch.int64), 0)

    def abort(self) -> None:
        """Rank 0, after a rank died: NCCL does not notice a dead peer (gloo does, its sockets close),
        so its communicators are aborted to release the kernels waiting on it."""
        if self.device_group is not self.cpu_group:
            self.device_group.abort()

    def close(self) -> None:
        """Rank 0, once the other ranks have stopped: shuts the process groups down while the
        interpreter is alive (a gloo worker thread left to interpreter teardown can abort the process,
        pytorch #190489). Idempotent; collectives after it raise EngineDeadError."""
        self.error = self.error or "the engine was shut down"
        groups, self._open_groups = self._open_groups, []
        for group in groups:
            group.shutdown()

    def _run(self, op, *args) -> None:
        """Runs the collective `op(*args)` to completion; raises EngineDeadError if it fails or the
        group already has."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        try:
            op(*args).wait()
        except RuntimeError as e:
            # rank 0 names the rank that died, if one did, and stops the others
            death = self.workers.on_collective_failure() if self.workers is not None else None
            self.error = self.error or death or f"tensor-parallel collective failed on rank {self.rank}: {e}"
            raise EngineDeadError(self.error) from e
