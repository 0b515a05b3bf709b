"""Pytest plugin for the server tests (a test module says `pytest_plugins = ["server_harness"]`):
the real server (`python server.py`) in a subprocess on a free 127.0.0.1 port, shared by every test
module that uses it, plus HTTP clients and a /metrics reader."""
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small enough to start in seconds; 64 sequences so the 64-client test runs in one batch.
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048, max_num_seqs=64)


class ServerProcess:
    """`python server.py --port 0 ARGS` with its log in a temporary file; the port is read from the
    "ready" line (the first match of `ready_pattern`'s group), so there is no race for a free port.

    Raises RuntimeError (with the log) if the server exits or is not ready within `timeout` seconds.
    """

    def __init__(self, *args: str, timeout: float = 180, ready_pattern: str = r"ready: (http://127\.0\.0\.1:\d+)"):
        self._log = tempfile.NamedTemporaryFile(prefix="server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "server.py", "--port", "0", *args], cwd=ROOT,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not (ready := re.search(ready_pattern, self.log())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"server did not start (exit {self.proc.wait()}):\n{self.log()}")
            time.sleep(0.1)
        self.url = ready.group(1)

    def log(self) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Sends `sig` and returns the exit status (killing the process if it outlives `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self._log.name)
        return self.proc.returncode


def cli_args(**engine_args) -> list[str]:
    """server.py flags from EngineConfig-style keyword arguments."""
    return [a for k, v in engine_args.items() for a in (f"--{k.replace('_', '-')}", str(v))]


@pytest.fixture(scope="session")
def engine_args() -> dict:
    """The engine arguments of the shared server, for building the same engine offline."""
    return dict(ENGINE_ARGS)


@pytest.fixture(scope="session")
def server():
    """The shared server on the default model, tool_choice "auto" on; it must exit 0 on SIGTERM at the end."""
    proc = ServerProcess(*cli_args(**ENGINE_ARGS), "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield proc
    log = proc.log()
    assert proc.stop() == 0, log[-4000:]


@pytest.fixture(scope="session")
def server_factory():
    """Starts extra servers with the given flags (on the default model); any still running at the
    end of the session are stopped."""
    started = []

    def start(*args: str) -> ServerProcess:
        started.append(ServerProcess(*args))
        return started[-1]

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
async def openai_client(server):
    async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
async def http(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        yield client


class MetricsReader:
    """Reads a server's /metrics into {name{labels}: value}, labels sorted, model_name left out."""

    def __init__(self, http: httpx.AsyncClient):
        self.http = http

    async def scrape(self) -> dict[str, float]:
        response = await self.http.get("/metrics")
        assert response.status_code == 200
        samples = {}
        for family in text_string_to_metric_families(response.text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return samples

    async def wait_until_idle(self, idle_usage: float = 0.0, timeout: float = 10) -> dict[str, float]:
        """Polls until nothing runs or waits and KV-cache usage is `idle_usage`; returns the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = await self.scrape()
            if (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"]) == (
                    0, 0, idle_usage):
                return m
            assert time.monotonic() < deadline, f"not idle after {timeout}s: {m}"
            await asyncio.sleep(0.05)


@pytest.fixture
def metrics(http) -> MetricsReader:
    return MetricsReader(http)
