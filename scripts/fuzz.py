"""Fuzz the server from its own OpenAPI document with schemathesis: every endpoint, schema-valid and
invalid bodies. Fails on any 5xx, any 4xx/5xx without OpenAI's error body (scripts/fuzz_checks.py), any
/health answer other than 200 during the run, or a server that is not idle afterwards (requests left
running or waiting, KV blocks not freed).

    python scripts/fuzz.py --max-examples 300            # thousands of cases (coverage + fuzzing phases)
    python scripts/fuzz.py --max-examples 25 --phases fuzzing     # ~310 cases in ~65 s (what the test runs)
    python scripts/fuzz.py --url http://127.0.0.1:8000   # against a server you started

The server started here has a short context (--max-model-len 64) so that generated requests (n up to
128, max_tokens up to the context) stay cheap; pass other flags after `--`.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from server_process import ServerProcess, is_idle, wait_idle

SCRIPTS = Path(__file__).resolve().parent
SERVER_ARGS = ["--dtype", "float32", "--kv-cache-memory", "128M", "--max-model-len", "64", "--max-num-seqs", "128"]


class HealthWatch(threading.Thread):
    """Polls GET /health every `interval` seconds until stopped; counts answers other than 200."""

    def __init__(self, url: str, interval: float = 0.25):
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.checks, self.failures = 0, []
        self._stop_event = threading.Event()

    def run(self):
        with httpx.Client(timeout=30) as client:
            while not self._stop_event.wait(self.interval):
                try:
                    status = client.get(f"{self.url}/health").status_code
                except httpx.HTTPError as e:
                    status = repr(e)
                self.checks += 1
                if status != 200:
                    self.failures.append(status)

    def stop(self):
        self._stop_event.set()
        self.join()


def schemathesis_command(url: str, args) -> list[str]:
    exe = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    return [
        exe,
        "run",
        f"{url}/openapi.json",
        "--checks",
        "not_a_server_error,openai_error_body",
        "--max-examples",
        str(args.max_examples),
        "--phases",
        args.phases,
        "--seed",
        str(args.seed),
        "--request-timeout",
        "300",
        "--workers",
        str(args.workers),
        "--no-shrink",
        "--warnings",
        "off",
    ]


def fuzz(url: str, args) -> bool:
    """Runs schemathesis against `url` while watching /health; prints the verdict, returns whether it passed."""
    watch = HealthWatch(url)
    watch.start()
    start = time.monotonic()
    env = os.environ | {
        "SCHEMATHESIS_HOOKS": "fuzz_checks",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")])),
    }
    with tempfile.TemporaryDirectory() as workdir:  # schemathesis keeps a .schemathesis/ cache in its cwd
        run = subprocess.run(schemathesis_command(url, args), env=env, capture_output=True, text=True, cwd=workdir)
    watch.stop()
    print(run.stdout[-6000:], run.stderr[-2000:], sep="\n")
    metrics = wait_idle(url)
    ok = run.returncode == 0 and not watch.failures and watch.checks > 0 and is_idle(metrics)
    print(
        f"schemathesis exit {run.returncode} in {time.monotonic() - start:.0f}s; /health {watch.checks} checks, "
        f"{len(watch.failures)} not 200 {watch.failures[:5]}; afterwards running "
        f"{metrics['vllm:num_requests_running']:.0f}, waiting {metrics['vllm:num_requests_waiting']:.0f}, "
        f"KV usage {metrics['vllm:kv_cache_usage_perc']:.3f}: {'PASS' if ok else 'FAIL'}"
    )
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="fuzz this server instead of starting one")
    ap.add_argument("--max-examples", type=int, default=300, help="generated cases per endpoint and phase")
    ap.add_argument("--phases", default="coverage,fuzzing", help="schemathesis phases (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="concurrent schemathesis workers")
    ap.add_argument("server_args", nargs="*", help=f"server.py flags after -- (default: {' '.join(SERVER_ARGS)})")
    args = ap.parse_args()
    if args.url:
        return 0 if fuzz(args.url, args) else 1
    with ServerProcess(args.server_args or SERVER_ARGS) as server:
        ok = fuzz(server.url, args)
        status = server.stop()
    print(f"server exit status {status}")
    return 0 if ok and status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
