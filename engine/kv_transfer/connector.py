"""The scheduler's side of disaggregated prefill/decode, with vLLM NixlConnector's semantics.

Protocol (what vllm-router's `--vllm-pd-disaggregation` speaks): the router sends the prompt to a
producer (prefill server) with `max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true}`.
When that request stops at its length limit, the producer keeps its KV blocks pinned and answers with
`kv_transfer_params: {"do_remote_prefill": true, "remote_engine_id", "remote_block_ids",
"remote_host", "remote_port", "remote_request_id"}`. The router sends the original request, with
those params, to a consumer (decode server), which allocates blocks for the prompt (after its own
prefix-cache hits), pulls every layer's K/V of the rest with one-sided NIXL reads, and schedules the
request like a prefix-cache hit of all prompt tokens but the last (whose logits it needs). The read
notifies the producer, which frees the pinned blocks; unread blocks are freed after
`abort_request_timeout` seconds.
"""

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.config.kv_transfer import KVTransferConfig
from engine.kv_transfer.nixl import NixlTransport
from engine.kv_transfer.side_channel import HandshakeServer, fetch_metadata

logger = logging.getLogger(__name__)


@dataclass
class KVConnectorOutput:
    """News from one `poll`: requests whose K/V arrived (to schedule), requests whose pull failed with
    the reason (to fail, blocks to free), and requests whose blocks are to be freed now (pinned
    requests that were pulled or expired; aborted pulls that ended)."""

    loaded: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    released: list = field(default_factory=list)


@dataclass
class _Load:
    request: object
    local_ids: list[int]
    remote_ids: list[int]
    engine_id: str
    host: str
    port: int
    remote_request_id: str
    handle: object = None
    ended: bool = False
    aborted: bool = False
    error: str | None = None


def _check_remote_prefill(params: dict, num_blocks: int) -> None:
    """Raises ValueError unless `params` (do_remote_prefill) name a producer and `num_blocks` blocks."""

    def bad(key, what):
        raise ValueError(f"kv_transfer_params.{key} must be {what}, got {params.get(key)!r}")

    for key in ("remote_engine_id", "remote_host", "remote_request_id"):
        if not isinstance(params.get(key), str) or not params[key]:
            bad(key, "a non-empty string")
    port = params.get("remote_port")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        bad("remote_port", "a port number")
    ids = params.get("remote_block_ids")
    if not isinstance(ids, list) or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in ids):
        bad("remote_block_ids", "a list of block ids")
    if len(ids) != num_blocks:
        raise ValueError(
            f"kv_transfer_params.remote_block_ids has {len(ids)} blocks; this prompt fills "
            f"{num_blocks} (the prefill server must run the same model, prompt and block size)"
        )


class NixlConnector:
    """KV transfer between engines over NIXL, in the role `config.kv_role`.

    Called by the scheduler from the engine's thread (requests are `engine.core.request.Request`s, which
    carry `kv_transfer_params`): producers pin finished requests' blocks (`request_finished`) and
    serve the handshake; consumers pull blocks (`get_num_new_matched_tokens`, `start_load`); both
    report progress through `poll`, which the engine calls before every step.

    Raises RuntimeError if NIXL is missing, OSError if the handshake port cannot be bound.
    """

    def __init__(self, config: KVTransferConfig, kv_cache: torch.Tensor, block_size: int):
        self.config = config
        self.block_size = block_size
        self.transport = NixlTransport(config.engine_id, kv_cache, block_size, config.kv_ip)
        self.server = (
            HandshakeServer(config.kv_ip, config.kv_port, self.transport.metadata()) if config.is_producer else None
        )
        self._pinned: dict[str, tuple[object, float]] = {}  # request id -> (request, free-by deadline)
        self._loads: dict[str, _Load] = {}
        self._handshakes: dict[tuple[str, int, str], Future] = {}
        self._addresses: dict[str, tuple[str, int]] = {}  # producer engine id -> its handshake address
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-handshake")
        self.num_failed_transfers = 0
        self.num_expired_requests = 0
        logger.info(
            "KV transfer: NixlConnector %s, engine_id %s%s",
            config.kv_role,
            config.engine_id,
            f", handshake on {config.kv_ip}:{self.server.port}" if self.server else "",
        )

    # -- producer ------------------------------------------------------------------------------
    def request_finished(self, request, block_ids: list[int]) -> dict | None:
        """For a finished request that asked for a remote decode and stopped at its length limit,
        pins its blocks (the caller must not free them; `poll` releases them) and returns the
        kv_transfer_params for the decode server. Otherwise returns None: free the blocks now."""
        params = request.kv_transfer_params
        if not (
            self.config.is_producer
            and params
            and params.get("do_remote_decode")
            and request.finish_reason == "length"
            and block_ids
        ):
            return None
        self._pinned[request.request_id] = (request, time.monotonic() + self.config.abort_request_timeout)
        self.transport.busy = True
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_block_ids": list(block_ids),
            "remote_host": self.config.kv_ip,
            "remote_port": self.server.port,
            "remote_request_id": request.request_id,
        }

    # -- consumer ------------------------------------------------------------------------------
    def check_request(self, params: dict | None, num_prompt_tokens: int, n: int) -> None:
        """Validates a new request's kv_transfer_params. Raises ValueError naming the bad field."""
        if not params:
            return
        if n != 1 and (params.get("do_remote_prefill") or params.get("do_remote_decode")):
            raise ValueError("kv_transfer_params needs n = 1")
        if self.config.is_consumer and params.get("do_remote_prefill"):
            _check_remote_prefill(params, -(-num_prompt_tokens // self.block_size))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Prompt tokens the request will pull from its prefill server: all but its local prefix-cache
        hit of `num_computed_tokens` (vLLM's hook of this name); 0 for an ordinary request."""
        params = request.kv_transfer_params
        if not (self.config.is_consumer and params and params.get("do_remote_prefill")):
            return 0
        return request.num_prompt_tokens - num_computed_tokens

    def start_load(self, request, local_block_ids: list[int]) -> None:
        """Starts pulling the request's last `len(local_block_ids)` prompt blocks into these blocks
        (allocated, not in the prefix cache until they arrive)."""
        params = request.kv_transfer_params
        load = _Load(
            request,
            list(local_block_ids),
            params["remote_block_ids"][-len(local_block_ids) :],
            params["remote_engine_id"],
            params["remote_host"],
            params["remote_port"],
            params["remote_request_id"],
        )
        self._loads[request.request_id] = load
        self.transport.busy = True
        self._advance(load)

    def abort_load(self, request) -> bool:
        """Forgets a pull of an aborted request. Returns True if its blocks can be freed now, False if a
        read into them is in flight (`poll` releases them when it ends)."""
        load = self._loads.get(request.request_id)
        if load is None or load.handle is None:  # no read in flight (not started, or it has ended)
            self._loads.pop(request.request_id, None)
            return True
        load.aborted = True
        return False

    def _advance(self, load: _Load) -> bool:
        """Moves a pull on (handshake, then read); returns True once it has ended (`error` if failed)."""
        load.ended = load.ended or self._step(load)
        return load.ended

    def _step(self, load: _Load) -> bool:
        if load.handle is None:
            if self._addresses.get(load.engine_id) != (load.host, load.port):  # a producer never met there
                key = (load.host, load.port, load.engine_id)
                future = self._handshakes.get(key)
                if future is None:
                    future = self._handshakes[key] = self._pool.submit(
                        fetch_metadata, load.host, load.port, self.config.handshake_timeout
                    )
                if not future.done():
                    return False
                del self._handshakes[key]
                try:
                    metadata = future.result()
                    if metadata.get("engine_id") != load.engine_id:
                        raise ValueError(
                            f"the KV producer at {load.host}:{load.port} is engine "
                            f"{metadata.get('engine_id')}, not {load.engine_id} (restarted?)"
                        )
                    self.transport.add_remote(metadata)
                    self._addresses[load.engine_id] = (load.host, load.port)
                except Exception as e:  # unreachable, wrong engine or incompatible cache: fail the pull
                    load.error = str(e)
                    return True
            try:
                load.handle = self.transport.read(
                    load.engine_id, load.local_ids, load.remote_ids, load.remote_request_id.encode()
                )
            except Exception as e:  # NIXL refused (e.g. block ids outside the producer's cache)
                load.error = f"the KV transfer from {load.host}:{load.port} could not start: {e!r}"
                return True
        state = self.transport.state(load.handle)
        if state == "PROC":
            return False
        self.transport.release(load.handle)
        load.handle = None
        if state != "DONE":
            load.error = f"the KV transfer from {load.host}:{load.port} failed"
        return True

    # -- both ----------------------------------------------------------------------------------
    def poll(self) -> KVConnectorOutput:
        """Advances pulls, and releases pinned blocks that were pulled or have expired."""
        out = KVConnectorOutput()
        if self.config.is_producer:
            for message in self.transport.notifications():
                pinned = self._pinned.pop(message.decode(errors="replace"), None)
                if pinned is not None:
                    out.released.append(pinned[0])
            now = time.monotonic()
            for request_id, (request, deadline) in list(self._pinned.items()):
                if now > deadline:
                    logger.warning(
                        "request %s: no decode server pulled its KV blocks within %g s; freeing them",
                        request_id,
                        self.config.abort_request_timeout,
                    )
                    del self._pinned[request_id]
                    self.num_expired_requests += 1
                    out.released.append(request)
        for request_id, load in list(self._loads.items()):
            if not self._advance(load):
                continue
            del self._loads[request_id]
            if load.aborted:
                out.released.append(load.request)
            elif load.error:
                logger.error("request %s: %s", request_id, load.error)
                self.num_failed_transfers += 1
                out.failed.append((load.request, load.error))
            else:
                out.loaded.append(load.request)
        self.transport.busy = bool(self._pinned or self._loads)
        return out

    @property
    def num_loading(self) -> int:
        """Requests waiting for their prompt's K/V to arrive."""
        return len(self._loads)

    def close(self) -> None:
        """Stops the handshake server and the transport's progress thread."""
        if self.server is not None:
            self.server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()

    def poll_interval(self) -> float | None:
        """Seconds an idle engine may sleep before polling again; None when there is nothing to watch."""
        if self._loads:
            return 0.001
        return 0.05 if self._pinned else None


class NoKVConnector:
    """The scheduler's KV-connector hooks when the engine has no KV transfer role: no token is ever pulled,
    no block is ever kept for a remote decode (kv_transfer_params in a request are ignored, as vLLM does
    without a connector)."""

    num_loading = num_failed_transfers = num_expired_requests = 0

    def check_request(self, params: dict | None, num_prompt_tokens: int, n: int) -> None:
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        return 0

    def request_finished(self, request, block_ids: list[int]) -> dict | None:
        return None

    def abort_load(self, request) -> bool:
        return True

    def poll(self) -> KVConnectorOutput:
        return KVConnectorOutput()

    def poll_interval(self) -> float | None:
        return None

    def close(self) -> None:
        pass
