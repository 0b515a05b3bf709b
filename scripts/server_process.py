"""What the scripts and tests that drive a live server share (fuzz.py, soak.py, bench_startup.py,
tests/server_harness.py): `python server.py` in a subprocess on a free port, its resident memory, and its
/metrics."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from api.memory_report import resident_bytes

REPO = Path(__file__).resolve().parents[1]


class ServerProcess:
    """`python server.py --port 0 ARGS` with its log in a temporary file; `url` is the first group of
    `ready_pattern` in the log (the "ready" line), so there is no race for a free port. `started` is the
    monotonic time just before the process was spawned. `env`: the server's environment (None: ours).

    Raises RuntimeError (with the log's tail) if the server exits or is not ready within `timeout` seconds.
    """

    def __init__(
        self,
        args: list[str],
        timeout: float = 300,
        ready_pattern: str = r"ready: (http://[\d.]+:\d+)",
        env: dict[str, str] | None = None,
    ):
        self._log = tempfile.NamedTemporaryFile(prefix="server-", suffix=".log", delete=False)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "server.py", "--port", "0", *args],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = self.started + timeout
        while not (ready := re.search(ready_pattern, self.log())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"server did not start (exit {self.proc.wait()}):\n{self.log()[-4000:]}")
            time.sleep(0.02)
        self.url = ready.group(1)

    def log(self) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def rss_bytes(self) -> int:
        """The server's resident set size in bytes (Linux /proc)."""
        return resident_bytes(self.proc.pid)

    def memory_report(self, timeout: float = 10) -> str:
        """Asks the server for its memory report (SIGUSR1, api/memory_report.py) and returns the line it
        logs, from "rss" on. Raises RuntimeError if none is logged within `timeout` seconds."""
        before = self.log().count("memory: rss")
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while self.log().count("memory: rss") == before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server logged no memory report within {timeout} s of SIGUSR1")
            time.sleep(0.05)
        return "rss" + self.log().split("memory: rss")[-1].splitlines()[0]

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (a graceful drain), then SIGKILL after `timeout` seconds; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def scrape(url: str) -> dict[str, float]:
    """/metrics as {sample name: value}, labels dropped (one model, so one series per name here)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "le" not in s.labels and "finished_reason" not in s.labels
    }


def is_idle(m: dict[str, float]) -> bool:
    """No request runs or waits and every KV block is free, by a /metrics scrape."""
    return (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"]) == (0, 0, 0)


def wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    """Polls /metrics until `is_idle` or `timeout` seconds; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while not is_idle(m := scrape(url)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return m
