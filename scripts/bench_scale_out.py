"""Data parallel behind vllm-router against one engine, on a prefix-heavy workload with concurrent
arrivals: throughput, TTFT and the prefix-cache hit rate of each routing policy.

Configurations (each started, measured and stopped in turn, all through vllm-router):
  1x2                  one engine on every core (`server.py`), vllm-router in front of it
  2x1:cache_aware      `server.py --data-parallel-size 2 --router-policy cache_aware` (one core each)
  2x1:round_robin      the same with round_robin
  1p1d                 disaggregated: a kv_producer and a kv_consumer server (every core each),
                       `vllm-router --vllm-pd-disaggregation` in front; "pulled" counts the prompt
                       tokens whose KV the decode server pulled instead of computing
For each, the benchmark is bench_serving.py's (streamed /v1/completions, Poisson arrivals at
--request-rate, greedy, ignore_eos), and the hit rate is prefix-cache hits / queries (vllm:prefix_cache_*,
in tokens) over every engine's /metrics, scraped before and after; "per engine" is how many requests
each engine served. A short request to each engine first warms it up (without touching the workload's
prefixes).

Usage:
  python scripts/bench_scale_out.py --dataset scripts/data/multi_prefix_workload.jsonl --request-rate 2 \\
      --result-dir results/scale_out
  python scripts/bench_scale_out.py --dataset scripts/data/prefix_workload.jsonl --request-rate 2
  python scripts/bench_scale_out.py --configs 2x1:cache_aware --num-prompts 8 --request-rate inf   # a quick check
"""

import argparse
import asyncio
import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_common import DATA_DIR, REPO, load_jsonl, run_info
from bench_serving import print_result, run_at_rate, served_model, summarize
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(REPO))
from api.data_parallel import free_port, router_command  # noqa: E402

CONFIGS = ["1x2", "2x1:cache_aware", "2x1:round_robin", "1p1d"]
KV_ROLE = '{{"kv_connector": "NixlConnector", "kv_role": "{}"}}'


class Deployment:
    """The processes of one configuration, each logging to a temporary file; `url` is the router's and
    `engines` the engines' URLs. Raises RuntimeError (with a log's tail) if it does not start."""

    def __init__(self, config: str, server_args: list[str], timeout: float = 600):
        self.procs: list[tuple[subprocess.Popen, str]] = []
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        if config in ("1x2", "1p1d"):
            roles = ["kv_producer", "kv_consumer"] if config == "1p1d" else [None]
            servers = [
                self._start(
                    [
                        sys.executable,
                        "server.py",
                        "--port",
                        "0",
                        *server_args,
                        *(["--kv-transfer-config", KV_ROLE.format(role)] if role else []),
                    ]
                )
                for role in roles
            ]
            self.engines = [self._wait(r"ready: (http://127\.0\.0\.1:\d+)", s, timeout) for s in servers]
            if config == "1x2":
                self._start(router_command("127.0.0.1", port, self.engines, "cache_aware"))
            else:
                self._start(
                    [
                        sys.executable,
                        "-m",
                        "vllm_router.launch_router",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--vllm-pd-disaggregation",
                        "--prefill",
                        self.engines[0],
                        "--decode",
                        self.engines[1],
                        "--prometheus-host",
                        "127.0.0.1",
                        "--prometheus-port",
                        str(free_port()),
                        "--log-level",
                        "warning",
                    ]
                )
            deadline = time.monotonic() + 60
            while not self._healthy(self.url):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm-router did not start:\n{self.log(self.procs[-1][0])[-3000:]}")
                time.sleep(0.2)
        else:
            policy = config.split(":")[1]
            launcher = self._start(
                [
                    sys.executable,
                    "server.py",
                    "--port",
                    str(port),
                    "--data-parallel-size",
                    "2",
                    "--router-policy",
                    policy,
                    *server_args,
                ]
            )
            self._wait(r"ready: (http://127\.0\.0\.1:\d+) \(OpenAI base_url .*vllm-router", launcher, timeout)
            self.engines = re.findall(r"replica \d: pid \d+ on (http://127\.0\.0\.1:\d+)", self.log(launcher))

    def _start(self, cmd: list[str]) -> subprocess.Popen:
        with tempfile.NamedTemporaryFile(prefix="scale-out-", suffix=".log", delete=False) as log:
            self.procs.append((subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log.name))
        return self.procs[-1][0]

    def _wait(self, pattern: str, proc: subprocess.Popen, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not (match := re.search(pattern, self.log(proc))):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{proc.args[:4]} did not start:\n{self.log(proc)[-3000:]}")
            time.sleep(0.2)
        return match.group(1)

    @staticmethod
    def _healthy(url: str) -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self, proc: subprocess.Popen) -> str:
        return Path(next(name for p, name in self.procs if p is proc)).read_text(errors="replace")

    def stop(self) -> None:
        for proc, log in reversed(self.procs):  # the router first
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            Path(log).unlink()


def scrape(engines: list[str]) -> list[dict[str, float]]:
    """Each engine's counters: prefix-cache queries and hits, pulled prompt tokens, finished requests."""
    out = []
    for url in engines:
        counts = {"queries": 0.0, "hits": 0.0, "requests": 0.0, "pulled": 0.0}
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
            for s in family.samples:
                key = {
                    "vllm:prefix_cache_queries_total": "queries",
                    "vllm:prefix_cache_hits_total": "hits",
                    "vllm:request_success_total": "requests",
                }.get(s.name)
                if s.name == "vllm:prompt_tokens_by_source_total" and s.labels["source"] == "external_kv_transfer":
                    key = "pulled"
                if key:
                    counts[key] += s.value
        out.append(counts)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=CONFIGS, help=f"from {CONFIGS} (default: all)")
    ap.add_argument("--dataset", default=str(DATA_DIR / "multi_prefix_workload.jsonl"))
    ap.add_argument("--num-prompts", type=int, help="use the first N requests (default: all)")
    ap.add_argument("--output-len", type=int, help="override every request's max_tokens")
    ap.add_argument("--request-rate", type=float, default=2.0, help="requests/s, Poisson arrivals; inf = all at once")
    ap.add_argument("--max-concurrency", type=int)
    ap.add_argument(
        "--server-args", default="--kv-cache-memory 1G", help="flags for every engine (default: %(default)s)"
    )
    ap.add_argument("--result-dir", help="write one JSON per configuration here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    bench_args = argparse.Namespace(
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        ignore_eos=True,
        disable_tqdm=True,
        dashboards=0,
        base_url=None,
    )
    reqs = load_jsonl(args.dataset, args.num_prompts, args.output_len)
    rows = []
    for config in args.configs:
        if config not in CONFIGS:
            ap.error(f"unknown configuration {config!r}; choose from {CONFIGS}")
        print(f"=== {config}: starting", flush=True)
        deployment = Deployment(config, args.server_args.split())
        try:
            model = served_model(deployment.url)
            for engine in deployment.engines:  # warm-up, on a prompt no request shares
                httpx.post(f"{engine}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120)
            before = scrape(deployment.engines)
            bench_args.base_url = deployment.url
            results, duration, _ = asyncio.run(
                run_at_rate(bench_args, deployment.url + "/v1/completions", model, reqs, args.request_rate)
            )
            after = scrape(deployment.engines)
        finally:
            deployment.stop()
        summary = summarize(results, duration, [50, 99])
        print_result(summary, args.request_rate, args.max_concurrency, [50, 99])
        delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
        hit_rate = sum(d["hits"] for d in delta) / max(sum(d["queries"] for d in delta), 1)
        per_engine = [int(d["requests"]) for d in delta]
        pulled = int(sum(d["pulled"] for d in delta))
        rows.append((config, summary, hit_rate, per_engine, pulled))
        if args.result_dir:
            path = Path(args.result_dir) / f"{config.replace(':', '-')}-rate{args.request_rate:g}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(
                json.dumps(
                    {
                        **run_info(),
                        "config": config,
                        "dataset": args.dataset,
                        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
                        "server_args": args.server_args,
                        "prefix_cache_hit_rate": hit_rate,
                        "requests_per_engine": per_engine,
                        "pulled_prompt_tokens": pulled,
                        **summary,
                    },
                    indent=1,
                )
            )
    print(f"\n{Path(args.dataset).name}, {len(reqs)} requests at {args.request_rate:g} req/s")
    print(
        "| config | req/s | output tok/s | prefix-cache hit rate | mean TTFT (ms) | median TTFT (ms) "
        "| P99 TTFT (ms) | median TPOT (ms) | requests per engine | pulled tokens | failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for config, s, hit_rate, per_engine, pulled in rows:
        print(
            f"| {config} | {s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {hit_rate:.1%} "
            f"| {s['mean_ttft_ms']:.0f} | {s['median_ttft_ms']:.0f} | {s['p99_ttft_ms']:.0f} "
            f"| {s['median_tpot_ms']:.1f} | {'/'.join(map(str, per_engine))} | {pulled} | {s['failed']} |"
        )


if __name__ == "__main__":
    main()
