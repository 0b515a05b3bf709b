"""Pytest plugin for the server tests (a test module says `pytest_plugins = ["server_harness"]`):
the real server (`python server.py`) in a subprocess on a free 127.0.0.1 port, shared by every test
module that uses it, plus HTTP clients and a /metrics reader."""

import asyncio
import os
import time

import httpx
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from scripts.server_process import ServerProcess  # noqa: F401 (also imported from here by test modules)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small enough to start in seconds; 64 sequences so the 64-client test runs in one batch.
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048, max_num_seqs=64)


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
    proc = ServerProcess(
        [*cli_args(**ENGINE_ARGS), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], timeout=180
    )
    yield proc
    log = proc.log()
    assert proc.stop() == 0, log[-4000:]


@pytest.fixture(scope="session")
def server_factory():
    """Starts extra servers with the given flags (on the default model); any still running at the
    end of the session are stopped."""
    started = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        started.append(ServerProcess(list(args), timeout=180, env=env))
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


def wait_healthy(url: str, procs, timeout: float = 300) -> None:
    """Polls `url`/health until it answers 200; fails if one of `procs` (Popen) exits first or after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert all(p.poll() is None for p in procs), f"a process exited while {url} started"
        assert time.monotonic() < deadline, f"{url} not healthy in {timeout} s"
        time.sleep(0.2)


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
                0,
                0,
                idle_usage,
            ):
                return m
            assert time.monotonic() < deadline, f"not idle after {timeout}s: {m}"
            await asyncio.sleep(0.05)


@pytest.fixture
def metrics(http) -> MetricsReader:
    return MetricsReader(http)
