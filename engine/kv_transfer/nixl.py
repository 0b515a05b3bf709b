"""The transport: one NIXL agent per engine with the whole KV cache registered once, and one-sided
READs of whole per-layer block slices from a remote engine's cache (NIXL, NVIDIA's Inference Xfer
Library, as vLLM's NixlConnector uses it; its UCX backend moves host memory by shared memory / cma on
one machine and by TCP between machines).

Only the cache's outer layout matters here: [num_layers, 2 (K, V), num_blocks, ...] with each block's
inner part contiguous. A transfer copies whole block slices, so the layout inside a block is free to
change, as long as both engines use the same one (the handshake compares slice sizes).
"""

import atexit
import base64
import dataclasses
import ipaddress
import os
import threading

import numpy as np
import torch

PROGRESS_INTERVAL = 0.001  # seconds between UCX progress calls while transfers may be under way
IDLE_PROGRESS_INTERVAL = 0.05  # and otherwise


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Where an engine's K/V block slices are, in bytes. Slice (layer l, kv 0=K/1=V, block b) is
    `chunk_bytes` long at `base_addr + l * layer_stride + kv * kv_stride + b * block_stride`.

    dtype and block_size (tokens per block) must match between two engines for their blocks to mean
    the same thing; mem_type is NIXL's "DRAM" (CPU) or "VRAM" (CUDA), device_id the CUDA device.
    """

    base_addr: int
    num_layers: int
    num_blocks: int
    chunk_bytes: int
    layer_stride: int
    kv_stride: int
    block_stride: int
    dtype: str
    block_size: int
    mem_type: str
    device_id: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor, block_size: int) -> "KVLayout":
        """The layout of a cache tensor [num_layers, 2, num_blocks, ...] whose blocks are contiguous.
        Raises ValueError for another shape."""
        if kv_cache.dim() < 4 or kv_cache.shape[1] != 2 or not kv_cache[0, 0, 0].is_contiguous():
            raise ValueError(
                f"KV cache must be [num_layers, 2, num_blocks, ...] with contiguous blocks, "
                f"got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}"
            )
        item = kv_cache.element_size()
        cuda = kv_cache.device.type == "cuda"
        return cls(
            base_addr=kv_cache.data_ptr(),
            num_layers=kv_cache.shape[0],
            num_blocks=kv_cache.shape[2],
            chunk_bytes=kv_cache[0, 0, 0].numel() * item,
            layer_stride=kv_cache.stride(0) * item,
            kv_stride=kv_cache.stride(1) * item,
            block_stride=kv_cache.stride(2) * item,
            dtype=str(kv_cache.dtype).removeprefix("torch."),
            block_size=block_size,
            mem_type="VRAM" if cuda else "DRAM",
            device_id=(kv_cache.device.index or 0) if cuda else 0,
        )

    def mismatch(self, other: "KVLayout") -> str | None:
        """Why blocks of `other` cannot be copied into ours (None if they can)."""
        for name in ("dtype", "block_size", "num_layers", "chunk_bytes"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} differs: {getattr(other, name)} there, {getattr(self, name)} here"
        return None

    def descs(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """NIXL descriptors (address, bytes, device) [2 * num_layers * len(starts), 3] uint64 for runs
        of `counts[i]` consecutive blocks from `starts[i]`, every layer's K and V.
        A run longer than one block needs `block_stride == chunk_bytes` (see `block_runs`)."""
        planes = (
            np.arange(self.num_layers)[:, None] * self.layer_stride + np.arange(2)[None, :] * self.kv_stride
        ).reshape(-1, 1)
        addrs = self.base_addr + planes + starts[None, :].astype(np.int64) * self.block_stride
        lens = np.broadcast_to(counts[None, :].astype(np.int64) * self.chunk_bytes, addrs.shape)
        out = np.empty((addrs.size, 3), dtype=np.uint64)
        out[:, 0], out[:, 1], out[:, 2] = addrs.ravel(), lens.ravel(), self.device_id
        return out


def block_runs(local_ids: list[int], remote_ids: list[int], contiguous: bool):
    """Splits block pairs (local_ids[i] <- remote_ids[i]) into runs that are consecutive on both
    sides, so each run of each layer's K or V is one descriptor. With `contiguous` False (blocks are
    not adjacent in memory on one side) every block is its own run.
    Returns int64 arrays (local starts, remote starts, counts)."""
    local, remote = np.asarray(local_ids, dtype=np.int64), np.asarray(remote_ids, dtype=np.int64)
    if contiguous and len(local) > 1:
        breaks = np.flatnonzero((np.diff(local) != 1) | (np.diff(remote) != 1)) + 1
    else:
        breaks = np.arange(1, len(local))
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    counts = np.diff(np.concatenate([starts, [len(local)]]))
    return local[starts], remote[starts], counts


class NixlTransport:
    """This engine's NIXL agent (named `engine_id`) with `kv_cache` registered, and the remote engines
    it has met. Call it from one thread (the engine's); a thread of its own progresses UCX.

    Raises RuntimeError when NIXL is not installed (the message gives the pip command).
    """

    def __init__(self, engine_id: str, kv_cache: torch.Tensor, block_size: int, host: str):
        # UCX listens on every interface unless told otherwise; keep a loopback-only setup on loopback.
        if ipaddress.ip_address(host).is_loopback:
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as e:
            raise RuntimeError(
                "--kv-transfer-config with NixlConnector needs NIXL: "
                'pip install -e ".[kv]" (nixl-cu13), then pip install --no-deps nixl'
            ) from e
        self.engine_id = engine_id
        self.layout = KVLayout.of(kv_cache, block_size)
        # NIXL's own progress thread never sleeps, which takes a core from the model on a CPU server;
        # ours (below) drives UCX every millisecond instead, so the agent must be thread-safe.
        self.agent = nixl_agent(
            engine_id,
            nixl_agent_config(
                backends=["UCX"], enable_prog_thread=False, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            ),
        )
        self._registration = self.agent.register_memory(kv_cache)
        self._kv_cache = kv_cache  # registered memory must outlive the agent's use of it
        self.remotes: dict[str, KVLayout] = {}
        self.busy = False  # set while transfers may be under way (blocks pinned, pulls in flight)
        self._notifs: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self._thread.start()
        # A daemon thread that comes back from NIXL's C++ (which drops the GIL) while the interpreter
        # finalizes is ended by pthread_exit inside a noexcept frame: std::terminate, and the process
        # aborts on its way out. Stop the thread before that, whoever forgot to call close().
        atexit.register(self.close)

    def _progress(self) -> None:
        """UCX moves only when its worker is progressed: peers' connection set-up and the reads they
        serve from our memory need it even while this engine is busy computing. Fetching notifications
        progresses the worker."""
        while not self._stop.wait(PROGRESS_INTERVAL if self.busy else IDLE_PROGRESS_INTERVAL):
            notifs = self.agent.get_new_notifs()
            if notifs:
                with self._lock:
                    self._notifs.extend(msg for msgs in notifs.values() for msg in msgs)

    def close(self) -> None:
        """Stops the progress thread and waits for it (the agent itself lives as long as this object).
        Idempotent; also run at interpreter exit."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        atexit.unregister(self.close)

    def metadata(self) -> dict:
        """What a peer needs to read from us: agent metadata (base64) and the cache layout."""
        return {
            "engine_id": self.engine_id,
            "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "layout": dataclasses.asdict(self.layout),
        }

    def add_remote(self, metadata: dict) -> None:
        """Loads a peer's metadata (from its `metadata()`). Raises ValueError if its blocks cannot be
        copied into ours."""
        layout = KVLayout(**metadata["layout"])
        why = self.layout.mismatch(layout)
        if why:
            raise ValueError(f"engine {metadata['engine_id']} has an incompatible KV cache: {why}")
        if metadata["engine_id"] in self.remotes:  # met before: take its metadata afresh
            self.agent.remove_remote_agent(metadata["engine_id"])
            del self.remotes[metadata["engine_id"]]
        name = self.agent.add_remote_agent(base64.b64decode(metadata["agent_metadata"]))
        self.remotes[name.decode() if isinstance(name, bytes) else name] = layout

    def read(self, remote: str, local_ids: list[int], remote_ids: list[int], notif: bytes):
        """Starts copying remote blocks into local ones (all layers' K and V); the remote agent gets
        `notif` when the copy is complete. Returns a handle for `state`/`release`.
        Raises ValueError for block ids outside either cache, or NIXL's error."""
        peer = self.remotes[remote]
        if any(not 0 <= b < peer.num_blocks for b in remote_ids):
            raise ValueError(f"remote block ids outside [0, {peer.num_blocks})")
        contiguous = self.layout.block_stride == self.layout.chunk_bytes and peer.block_stride == peer.chunk_bytes
        local_starts, remote_starts, counts = block_runs(local_ids, remote_ids, contiguous)
        mem = self.layout.mem_type
        local = self.agent.get_xfer_descs(self.layout.descs(local_starts, counts), mem)
        remote_descs = self.agent.get_xfer_descs(peer.descs(remote_starts, counts), peer.mem_type)
        handle = self.agent.initialize_xfer("READ", local, remote_descs, remote, notif)
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError("NIXL could not post the transfer")
        return handle

    def state(self, handle) -> str:
        """ "DONE", "PROC" (in progress) or "ERR"."""
        return self.agent.check_xfer_state(handle)

    def release(self, handle) -> None:
        self.agent.release_xfer_handle(handle)

    def notifications(self) -> list[bytes]:
        """Messages that arrived from peers since the last call (their finished reads)."""
        with self._lock:
            out, self._notifs = self._notifs, []
        return out
