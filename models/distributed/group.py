"""One engine's ranks: the tensor-parallel collectives of the model shards (`TPGroup`), the pipeline
stages' point-to-point sends of the residual stream, and the delivery of each step's description from rank 0
(which runs the scheduler) to every other rank, each of which builds its own inputs from it
(`ParallelGroup`).

Rank r is tensor-parallel rank r % T of pipeline stage r // T (T ranks per stage, vLLM's order). Rank 0
broadcasts a step to its own stage; each rank of a stage passes it on to the same tensor-parallel rank of
the next stage, before that step's residual stream, without waiting for it to be received: so a stage
busy with one step never holds up the stages before it, and P steps can be in flight in P stages. The
first tensor-parallel rank of the last stage samples and sends the step's output back to rank 0.

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
    """A rank died, or a collective failed or timed out: the engine cannot run again."""


# point-to-point tags: a step's description, a stage's residual stream, a step's output
STEP_TAG, HIDDEN_TAG, OUTPUT_TAG = 1, 2, 3


class ParallelGroup:
    """The ranks of one engine (tensor_parallel_size x pipeline_parallel_size), seen from one rank.

    rank, world_size: this rank and the number of ranks; tp_size: ranks per pipeline stage; pp_size:
    stages. device: this rank's device (cuda:rank on CUDA). master_addr: rank 0's address (gloo listens on
    this host's address toward it; gloo_device). timeout: how long every collective but the idle wait for a
    step may take (a timedelta). `tp`: this stage's TPGroup for the model's collectives (None with one
    rank per stage). The step headers, outputs and start-up agreement go over gloo (`cpu_group`); the
    residual stream between stages over `device_group` (gloo on the CPU, NCCL on CUDA). `error` is None
    while the group works, else why it stopped; on rank 0 `workers` (set by the launcher) names a dead rank
    and stops the others.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        device: torch.device,
        master_addr: str,
        timeout: timedelta = COLLECTIVE_TIMEOUT,
        tp_size: int | None = None,
    ):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.tp_size = tp_size or world_size
        self.pp_size = world_size // self.tp_size
        self.pp_rank, self.tp_rank = divmod(rank, self.tp_size)
        self.is_driver = self.pp_rank == self.pp_size - 1 and self.tp_rank == 0  # samples; answers rank 0
        gloo = dist.ProcessGroupGloo._Options()
        gloo._devices = [gloo_device(master_addr)]
        gloo._timeout = timeout
        self.cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world_size, gloo)
        nccl = None
        if device.type == "cuda":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = timeout
            self.device_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size, nccl)
        else:
            self.device_group = self.cpu_group
        if self.pp_size == 1:  # the stage is the world
            self.stage_cpu_group, stage_device_group = self.cpu_group, self.device_group
        else:  # every rank builds its own stage's groups only
            prefix = dist.PrefixStore(f"stage{self.pp_rank}", store)
            self.stage_cpu_group = dist.ProcessGroupGloo(
                dist.PrefixStore("gloo", prefix), self.tp_rank, self.tp_size, gloo
            )
            stage_device_group = (
                dist.ProcessGroupNCCL(dist.PrefixStore("nccl", prefix), self.tp_rank, self.tp_size, nccl)
                if nccl is not None
                else self.stage_cpu_group
            )
        self.tp = TPGroup(self, stage_device_group) if self.tp_size > 1 else None
        self.error: str | None = None
        self.workers = None
        groups = (self.device_group, self.cpu_group, self.stage_cpu_group, stage_device_group)
        self._open_groups = list({id(g): g for g in groups}.values())
        self._sends: list = []  # (work, tensor) of point-to-point sends not known to be done

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def min(self, value: int) -> int:
        """The smallest of every rank's `value` (ranks agree on a KV-cache size at start-up)."""
        t = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._run(self.cpu_group.allreduce, [t], options)
        return int(t.item())

    def send_step(self, step) -> None:
        """Rank 0: sends one step's description (a picklable object: the executor sends the SchedulerOutput
        and the grammar masks) to the other ranks: its size, then its pickled bytes, broadcast over the
        first stage and passed on to the next stage."""
        payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        self._deliver(
            torch.tensor([len(payload)], dtype=torch.int64), torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        )

    def recv_step(self):
        """Other ranks: waits for rank 0's next step (passing it on to the next stage); returns what rank 0
        passed to `send_step`, or None after `stop`. Raises EngineDeadError when rank 0 is gone."""
        header = torch.empty(1, dtype=torch.int64)
        if self.pp_rank == 0:
            self._run(self.stage_cpu_group.broadcast, header, 0, IDLE_TIMEOUT)
        else:
            self._run(self.cpu_group.recv, [header], self.rank - self.tp_size, STEP_TAG, wait=IDLE_TIMEOUT)
        size = int(header.item())
        payload = torch.empty(max(size, 0), dtype=torch.uint8)
        if size >= 0:
            if self.pp_rank == 0:
                self._run(self.stage_cpu_group.broadcast, payload, 0)
            else:
                self._run(self.cpu_group.recv, [payload], self.rank - self.tp_size, STEP_TAG)
        if not self.is_last_stage:
            self._send(self.cpu_group, header, self.rank + self.tp_size, STEP_TAG)
            if size >= 0:
                self._send(self.cpu_group, payload, self.rank + self.tp_size, STEP_TAG)
        return pickle.loads(payload.numpy().tobytes()) if size >= 0 else None

    def stop(self) -> None:
        """Rank 0: tells the other ranks to leave their step loop (they exit with status 0)."""
        self._deliver(torch.tensor([-1], dtype=torch.int64), None)

    def _deliver(self, header: torch.Tensor, payload: torch.Tensor | None) -> None:
        if self.tp_size > 1:
            self._run(self.stage_cpu_group.broadcast, header, 0)
            if payload is not None:
                self._run(self.stage_cpu_group.broadcast, payload, 0)
        if self.pp_size > 1:
            self._send(self.cpu_group, header, self.tp_size, STEP_TAG)
            if payload is not None:
                self._send(self.cpu_group, payload, self.tp_size, STEP_TAG)

    def send_hidden(self, x: torch.Tensor) -> None:
        """A stage but the last: sends its residual stream x (float32 [T, hidden]) to the same
        tensor-parallel rank of the next stage, without waiting for it to arrive."""
        self._send(self.device_group, x, self.rank + self.tp_size, HIDDEN_TAG)

    def recv_hidden(self, num_tokens: int, hidden_size: int) -> torch.Tensor:
        """A stage but the first: the previous stage's residual stream (float32 [num_tokens, hidden_size])."""
        x = torch.empty(num_tokens, hidden_size, dtype=torch.float32, device=self.device)
        self._run(self.device_group.recv, [x], self.rank - self.tp_size, HIDDEN_TAG)
        return x

    def send_output(self, output) -> None:
        """The last stage's driver (not rank 0): sends a step's output (picklable) to rank 0, not waiting."""
        payload = pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL)
        self._send(self.cpu_group, torch.tensor([len(payload)], dtype=torch.int64), 0, OUTPUT_TAG)
        self._send(self.cpu_group, torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, OUTPUT_TAG)

    def recv_output(self):
        """Rank 0: the next step's output from the last stage's driver (steps answer in order)."""
        driver = self.world_size - self.tp_size
        header = torch.empty(1, dtype=torch.int64)
        self._run(self.cpu_group.recv, [header], driver, OUTPUT_TAG)
        payload = torch.empty(int(header.item()), dtype=torch.uint8)
        self._run(self.cpu_group.recv, [payload], driver, OUTPUT_TAG)
        return pickle.loads(payload.numpy().tobytes())

    def _send(self, group, x: torch.Tensor, dst: int, tag: int) -> None:
        """Starts sending x to rank dst and returns; x is kept alive until the send is seen done."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        try:
            self._sends.append((group.send([x], dst, tag), x))
        except RuntimeError as e:
            self._failed(e)

    def flush(self) -> None:
        """Waits until every send started here has been received (a rank about to exit)."""
        for work, _ in self._sends:
            self._run(lambda w=work: w)
        self._sends = []

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
        self._sends = []
        for group in groups:
            group.shutdown()

    def _run(self, op, *args, wait: timedelta | None = None) -> None:
        """Runs the collective or point-to-point `op(*args)` to completion (waiting at most `wait` when
        given, else the group's timeout); raises EngineDeadError if it fails or the group already has."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        try:
            work = op(*args)
            work.wait(wait) if wait is not None else work.wait()
        except RuntimeError as e:
            self._failed(e)

    def _failed(self, e: RuntimeError) -> None:
        """Marks the group dead after a failed operation and raises EngineDeadError."""
        death = self.workers.on_collective_failure() if self.workers is not None else None
        self.error = self.error or death or f"collective failed on rank {self.rank}: {e}"
        raise EngineDeadError(self.error) from e


class TPGroup:
    """One pipeline stage's tensor-parallel ranks, as the model's parallel layers see them (models/layers):
    rank and world_size within the stage, `all_reduce` and `gather` over `group` (gloo on the CPU, NCCL on
    CUDA); failures go through the engine's ParallelGroup `parent`."""

    def __init__(self, parent: ParallelGroup, group):
        self.parent, self.group = parent, group
        self.rank, self.world_size, self.device = parent.tp_rank, parent.tp_size, parent.device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x (any shape and dtype, on `device`) over the ranks, in place; returns x."""
        self.parent._run(self.group.allreduce, [x])
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenates every rank's x [N, D] (rank order) along the last dim: [N, world_size * D] on
        rank 0, None on the others (rank 0 alone samples, so the others need no logits)."""
        if self.rank != 0:
            self.parent._run(self.group.gather, [], [x])
            return None
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.parent._run(self.group.gather, [parts], [x])
        return torch.cat(parts, dim=-1)
