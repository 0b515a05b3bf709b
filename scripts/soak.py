"""Soak test: thousands of mixed requests over many minutes, with a burst of concurrent streams in the
middle, then checks that nothing leaked.

    python scripts/soak.py                                           # 10,000 requests over 10 minutes
    python scripts/soak.py --duration 60 --num-requests 600 --peak-streams 200    # a short proof run
    python scripts/soak.py --output-json results/soak.json -- --kv-cache-memory 2G   # server flags after --
    python scripts/soak.py --phases 5 --duration 60 --num-requests 1000 --peak-streams 300   # memory over time

Requests arrive at random (Poisson) at num_requests / duration per second, except `peak_streams` streams
started together halfway. The mix: /v1/completions and /v1/chat/completions, streamed or not, n of 1-3,
stop strings, logprobs, prompt scoring (echo + logprobs, max_tokens 0), and clients that disconnect at a
random point (after a few chunks, or before a non-streamed answer). Passes when: no request failed (a
status other than 200, a broken stream, a timeout), afterwards every KV block is free and no request
runs or waits (/metrics), and the server's resident memory grew less than 10% from the first minute to
the last (mean of 1 s samples; windows of duration / 5 for runs under 5 minutes).

With --phases N it answers whether memory plateaus: on one server, a warm-up phase and then N identical
phases (the same seed, so the same request mix, burst and disconnects), each ending idle, with the
server's resident memory once idle after each (mean of 3 s of samples) and its memory report (SIGUSR1,
api/memory_report.py: glibc malloc's arenas, bytes in use and free in them; with --tracemalloc the
Python source lines holding the most, at a cost in speed). Bytes in use that grow phase after phase are
a leak; free bytes that stay in the arenas are the allocator's high-water mark. Passes when every phase
had no error and ended idle, and each of the last three phases grew the idle RSS by less than 1% over
the phase before. Run it under another allocator by setting the environment the server inherits
(LD_PRELOAD, MALLOC_ARENA_MAX).
"""

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time

import httpx
from bench_common import DEFAULT_WORKLOAD, run_info
from server_process import ServerProcess, is_idle, wait_idle

SERVER_ARGS = ["--max-num-seqs", "256"]


def prompts() -> list[str]:
    """Prompt texts: the benchmark workload's, cut to 20-400 characters."""
    with open(DEFAULT_WORKLOAD) as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()]
    rng = random.Random(0)
    return [t[: rng.randint(20, 400)] for t in texts]


def make_request(rng: random.Random, texts: list[str], stream: bool | None = None) -> tuple[str, dict, float | None]:
    """(path, body, disconnect point or None): the disconnect point is a chunk count for streams and
    seconds for non-streamed requests."""
    chat = rng.random() < 0.3
    stream = rng.random() < 0.6 if stream is None else stream
    body = {
        "max_tokens": rng.randint(4, 32),
        "temperature": rng.choice([0, 0.7, 1.0]),
        "stream": stream,
        "n": rng.choice([1, 1, 1, 2, 3]),
    }
    if rng.random() < 0.3:
        body["stop"] = rng.sample([".", "\n", " the", ",", "!"], rng.randint(1, 2))
    text = rng.choice(texts)
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.2:
            body |= {"logprobs": True, "top_logprobs": rng.randint(0, 3)}
    else:
        path = "/v1/completions"
        body["prompt"] = text
        if rng.random() < 0.2:
            body["logprobs"] = rng.randint(0, 3)
        if not stream and rng.random() < 0.05:  # score a text, as evaluation harnesses do
            body |= {"max_tokens": 0, "echo": True, "logprobs": 1, "n": 1}
    disconnect = None
    if rng.random() < 0.1:
        disconnect = rng.randint(1, 6) if stream else rng.uniform(0.05, 1.0)
    return path, body, disconnect


class Stats:
    def __init__(self):
        self.latencies, self.errors, self.disconnects, self.completed = [], [], 0, 0


async def run_one(client: httpx.AsyncClient, path: str, body: dict, disconnect, stats: Stats) -> None:
    start = time.monotonic()
    try:
        if body["stream"]:
            chunks, done = 0, False
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    stats.errors.append(f"{path} {r.status_code}: {(await r.aread())[:200]!r}")
                    return
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        if '"error"' in line[:20]:
                            stats.errors.append(f"{path} stream error: {line[:200]}")
                            return
                        chunks += 1
                        if disconnect is not None and chunks >= disconnect:
                            stats.disconnects += 1
                            return  # leaving the block closes the connection mid-stream
            if not done:
                stats.errors.append(f"{path} stream ended without [DONE]")
                return
        else:
            request = asyncio.ensure_future(client.post(path, json=body))
            if disconnect is not None:
                await asyncio.wait({request}, timeout=disconnect)
                if not request.done():
                    request.cancel()  # the client goes away before the answer
                    stats.disconnects += 1
                    return
            r = await request
            if r.status_code != 200 or len(r.json()["choices"]) != body["n"]:
                stats.errors.append(f"{path} {r.status_code}: {r.text[:200]}")
                return
        stats.latencies.append(time.monotonic() - start)
        stats.completed += 1
    except (httpx.HTTPError, KeyError, ValueError) as e:
        stats.errors.append(f"{path} {e!r}")


async def sample_rss(server: ServerProcess | None, samples: list, stop: asyncio.Event, start: float) -> None:
    while server is not None and not stop.is_set():
        samples.append((round(time.monotonic() - start, 1), server.rss_bytes()))
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def soak(url: str, server: ServerProcess | None, args) -> dict:
    rng = random.Random(args.seed)
    texts = prompts()
    stats, rss, stop = Stats(), [], asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.peak_streams + 100)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        start = time.monotonic()
        sampler = asyncio.create_task(sample_rss(server, rss, stop, start))
        tasks, peak_at, sent = [], args.duration / 2, 0
        rate = args.num_requests / args.duration
        next_at = 0.0
        while sent < args.num_requests:
            now = time.monotonic() - start
            if peak_at is not None and now >= peak_at:
                burst = min(args.peak_streams, args.num_requests - sent)
                tasks += [
                    asyncio.create_task(run_one(client, *make_request(rng, texts, stream=True)[:2], None, stats))
                    for _ in range(burst)
                ]
                sent, peak_at = sent + burst, None
                print(f"[{now:6.0f}s] burst of {burst} concurrent streams", flush=True)
                continue
            if now < next_at:
                await asyncio.sleep(min(next_at - now, 0.05))
                continue
            tasks.append(asyncio.create_task(run_one(client, *make_request(rng, texts), stats)))
            sent += 1
            next_at += rng.expovariate(rate)
            if sent % 500 == 0:
                print(
                    f"[{now:6.0f}s] {sent} sent, {stats.completed} completed, {stats.disconnects} disconnected, "
                    f"{len(stats.errors)} errors",
                    flush=True,
                )
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - start
        metrics = await asyncio.to_thread(wait_idle, url, 120)
        stop.set()
        await sampler
    window = 60 if args.duration >= 300 else args.duration / 5
    first = [b for t, b in rss if t <= window]
    last = [b for t, b in rss if t >= rss[-1][0] - window] if rss else []
    growth = statistics.mean(last) / statistics.mean(first) - 1 if first and last else None
    lat = sorted(stats.latencies)
    result = {
        "requests": args.num_requests,
        "completed": stats.completed,
        "disconnected": stats.disconnects,
        "errors": len(stats.errors),
        "error_samples": stats.errors[:10],
        "elapsed_s": round(elapsed, 1),
        "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
        "latency_p99_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3) if lat else None,
        "peak_streams": args.peak_streams,
        "idle_after": is_idle(metrics),
        "kv_cache_usage_after": metrics["vllm:kv_cache_usage_perc"],
        "running_after": metrics["vllm:num_requests_running"],
        "waiting_after": metrics["vllm:num_requests_waiting"],
        "rss_growth": round(growth, 4) if growth is not None else None,
        "rss_mib": [(t, round(b / 2**20)) for t, b in rss[::5]],
    }
    result["passed"] = result["errors"] == 0 and result["idle_after"] and (growth is None or growth < 0.10)
    return result


async def idle_rss(server: ServerProcess, seconds: float = 3.0) -> int:
    """Mean resident memory (bytes) of an idle server over `seconds`, sampled every 0.5 s."""
    samples = []
    for _ in range(int(seconds / 0.5)):
        samples.append(server.rss_bytes())
        await asyncio.sleep(0.5)
    return int(statistics.mean(samples))


def _mib(pattern: str, report: str) -> float:
    return float(re.search(pattern, report).group(1))


async def phases(server: ServerProcess, args) -> dict:
    """A warm-up phase, then args.phases identical ones; the idle RSS after each (see the module doc)."""
    results = []
    for phase in range(args.phases + 1):
        print(f"phase {phase}{' (warm-up)' if phase == 0 else ''}", flush=True)
        r = await soak(server.url, server, args)
        r["idle_rss_mib"] = round(await idle_rss(server) / 2**20, 1)
        r["memory"] = await asyncio.to_thread(server.memory_report)
        results.append(r)
        print(
            f"phase {phase}: {r['completed']} completed, {r['errors']} errors, idle {r['idle_after']}, "
            f"idle RSS {r['idle_rss_mib']} MiB\n  {r['memory']}",
            flush=True,
        )
    rss = [r["idle_rss_mib"] for r in results]
    growth = [round(b / a - 1, 4) for a, b in zip(rss, rss[1:])]
    return {
        "malloc_in_use_mib": [_mib(r"([\d.]+) MiB in use", r["memory"]) for r in results],
        "malloc_free_mib": [_mib(r"([\d.]+) MiB free in arenas", r["memory"]) for r in results],
        "memory_reports": [r["memory"] for r in results],
        "phases": args.phases,
        "requests_per_phase": args.num_requests,
        "peak_streams": args.peak_streams,
        "errors": sum(r["errors"] for r in results),
        "error_samples": [e for r in results for e in r["error_samples"]][:10],
        "idle_after_each": all(r["idle_after"] for r in results),
        "idle_rss_mib": rss,
        "rss_growth_per_phase": growth,
        "elapsed_s": [r["elapsed_s"] for r in results],
        "passed": all(r["errors"] == 0 and r["idle_after"] for r in results) and all(g < 0.01 for g in growth[-3:]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="soak this server (no RSS curve) instead of starting one")
    ap.add_argument("--duration", type=float, default=600, help="seconds over which requests are sent")
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--peak-streams", type=int, default=1000, help="concurrent streams started together halfway")
    ap.add_argument("--timeout", type=float, default=900, help="per-request timeout in seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--phases", type=int, default=0, help="after a warm-up, N identical phases on one server")
    ap.add_argument(
        "--tracemalloc",
        action="store_true",
        help="with --phases: the server traces Python allocations (PYTHONTRACEMALLOC=1), and each "
        "phase's report names the source lines holding the most (slower)",
    )
    ap.add_argument("server_args", nargs="*", help=f"server.py flags after -- (default: {' '.join(SERVER_ARGS)})")
    args = ap.parse_args()
    if args.phases and args.url:
        ap.error("--phases measures the server's memory: it starts its own (no --url)")
    if args.tracemalloc and not args.phases:
        ap.error("--tracemalloc goes with --phases")
    if args.phases:
        env = os.environ | ({"PYTHONTRACEMALLOC": "1"} if args.tracemalloc else {})
        with ServerProcess(args.server_args or SERVER_ARGS, env=env) as server:
            result = asyncio.run(phases(server, args))
            result["server_exit_status"] = server.stop()
    elif args.url:
        result = asyncio.run(soak(args.url, None, args))
    else:
        with ServerProcess(args.server_args or SERVER_ARGS) as server:
            result = asyncio.run(soak(server.url, server, args))
            result["server_exit_status"] = server.stop()
    result |= {"args": vars(args), "run": run_info()}
    summary = {k: v for k, v in result.items() if k not in ("rss_mib", "run", "args")}
    print(json.dumps(summary, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    print("PASS" if result["passed"] else "FAIL")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
