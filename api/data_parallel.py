"""`python server.py --data-parallel-size N`: N engine replicas behind vllm-router.

Each replica is its own `python -m api.cli` process on a free 127.0.0.1 port, with `--data-parallel-rank
i` (which labels its /metrics), bound to its share of the CPU cores (threads follow the affinity) or
to one GPU (`CUDA_VISIBLE_DEVICES`). vllm-router (the Rust router of vLLM's production stack, the
`[router]` extra) listens on --host:--port in front of them with `--router-policy`; cache_aware keeps
requests that share a prefix on the replica that caches it. The launcher waits for every replica's
/health, restarts none (a replica that dies is logged and the router's health checks take it out),
and on SIGINT/SIGTERM stops the router and every replica by PID and exits 0.
"""

import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

logger = logging.getLogger("api")

# vllm-router's policies that work with plain engine URLs (kv_aware needs a KV-event stream we lack)
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "consistent_hash", "sticky_least_loaded")
STARTUP_TIMEOUT = 900.0  # seconds for every replica to load its model and answer /health
HEALTH_CHECK_INTERVAL = 10  # seconds between the router's health checks of each replica


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment for a child `python -m api.cli` (plus `extra`), with this package's root first on PYTHONPATH
    so that the child runs this very code."""
    package_root = str(Path(__file__).resolve().parent.parent)
    pythonpath = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    return os.environ | (extra or {}) | {"PYTHONPATH": pythonpath}


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _placements(n: int) -> list[dict]:
    """Per replica: the environment (one GPU each on CUDA) and the CPU cores (an equal share each)."""
    import torch

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if n > len(devices):
            raise ValueError(f"--data-parallel-size {n} needs {n} GPUs, {len(devices)} visible")
        per = max(len(cores) // n, 1)
        return [
            {"env": {"CUDA_VISIBLE_DEVICES": devices[i]}, "cores": cores[i * per : (i + 1) * per] or cores}
            for i in range(n)
        ]
    if n > len(cores):
        raise ValueError(f"--data-parallel-size {n} needs {n} CPU cores, {len(cores)} available to this process")
    per = len(cores) // n
    return [{"env": {}, "cores": cores[i * per : (i + 1) * per]} for i in range(n)]


def router_command(
    host: str, port: int, worker_urls: list[str], policy: str, log_level: str = "info", api_key: str | None = None
) -> list[str]:
    """The vllm-router command line serving `worker_urls` on host:port (its Prometheus port on a free
    127.0.0.1 port; its own logs at warning level unless `log_level` is debug)."""
    cmd = [
        sys.executable,
        "-m",
        "vllm_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--health-check-interval-secs",
        str(HEALTH_CHECK_INTERVAL),
        "--log-level",
        "debug" if log_level == "debug" else "warning",
    ]
    return cmd + (["--api-key", api_key] if api_key else [])


class _Fleet:
    """The router and replica processes, stopped together by PID."""

    def __init__(self):
        self.replicas: list[subprocess.Popen] = []
        self.router: subprocess.Popen | None = None

    def stop(self, timeout: float = 30) -> None:
        procs = ([self.router] if self.router else []) + self.replicas
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.warning("pid %d did not stop within %gs; killing it", proc.pid, timeout)
                proc.kill()
                proc.wait()


def serve(args, argv: list[str]) -> int:
    """Runs replicas + router until SIGINT/SIGTERM (returns 0) or until the router or every replica
    dies, or startup fails (returns 1). `argv`: the command line, passed on to every replica."""
    if importlib.util.find_spec("vllm_router") is None:
        logger.error('--data-parallel-size needs vllm-router: pip install -e ".[router]"')
        return 1
    n = args.data_parallel_size
    try:
        placements = _placements(n)
    except ValueError as e:
        logger.error("%s", e)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    fleet = _Fleet()
    try:
        status = _run(args, argv, placements, fleet, stop)
    finally:
        fleet.stop()
    if status == 0:
        logger.info("stopped the router and %d replicas", n)
    return status


def _run(args, argv: list[str], placements: list[dict], fleet: _Fleet, stop: threading.Event) -> int:
    urls = []
    for rank, place in enumerate(placements):
        port = free_port()
        urls.append(f"http://127.0.0.1:{port}")
        env = child_env(place["env"])
        cores = place["cores"]
        # later flags win in argparse: these override the launcher's own --host/--port/--data-parallel-size
        cmd = [
            sys.executable,
            "-m",
            "api.cli",
            *argv,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--data-parallel-size",
            "1",
            "--data-parallel-rank",
            str(rank),
        ]
        bind = (lambda c=cores: os.sched_setaffinity(0, c)) if hasattr(os, "sched_setaffinity") else None
        fleet.replicas.append(subprocess.Popen(cmd, env=env, preexec_fn=bind))
        logger.info(
            "replica %d: pid %d on %s, cores %s%s",
            rank,
            fleet.replicas[-1].pid,
            urls[-1],
            ",".join(map(str, cores)),
            "".join(f", {k}={v}" for k, v in place["env"].items()),
        )
    deadline = time.monotonic() + STARTUP_TIMEOUT
    waiting = set(range(len(urls)))
    while waiting:
        if stop.is_set():
            return 0
        for rank in sorted(waiting):
            code = fleet.replicas[rank].poll()
            if code is not None:
                logger.error("replica %d exited with status %d during startup", rank, code)
                return 1
            if _healthy(urls[rank]):
                waiting.discard(rank)
        if time.monotonic() > deadline:
            logger.error("replicas %s not healthy after %gs", sorted(waiting), STARTUP_TIMEOUT)
            return 1
        stop.wait(0.5)

    port = args.port or free_port(args.host)
    fleet.router = subprocess.Popen(
        router_command(args.host, port, urls, args.router_policy, args.log_level, args.api_key)
    )
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{port}"
    logger.info("vllm-router: pid %d on %s", fleet.router.pid, url)
    while not _healthy(url):
        if stop.is_set():
            return 0
        if fleet.router.poll() is not None:
            logger.error("vllm-router exited with status %d during startup", fleet.router.returncode)
            return 1
        stop.wait(0.2)
    logger.info(
        "ready: %s (OpenAI base_url %s/v1; vllm-router, policy %s, %d replicas: %s)",
        url,
        url,
        args.router_policy,
        len(urls),
        " ".join(urls),
    )

    dead: set[int] = set()
    while not stop.wait(0.5):
        if fleet.router.poll() is not None:
            logger.error("vllm-router exited with status %d; stopping the replicas", fleet.router.returncode)
            return 1
        for rank, proc in enumerate(fleet.replicas):
            if rank not in dead and proc.poll() is not None:
                dead.add(rank)
                logger.error(
                    "replica %d (pid %d) exited with status %d; not restarted (the router's health checks take it out)",
                    rank,
                    proc.pid,
                    proc.returncode,
                )
        if len(dead) == len(fleet.replicas):
            logger.error("no replica left; stopping the router")
            return 1
    return 0
