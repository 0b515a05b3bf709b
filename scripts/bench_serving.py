"""Online serving benchmark for any OpenAI-compatible server (ours, vLLM, llama.cpp), measured the
way vLLM's `vllm bench serve` measures itself.

Sends the workload's requests to /v1/completions with stream=True, starting them as a Poisson process
at --request-rate (requests/s; inf = all at once) with at most --max-concurrency in flight, and times
each request (milliseconds):
  TTFT  time to first token: from sending the request to the first chunk that carries text
  TPOT  time per output token after the first: (E2EL - TTFT) / (output tokens - 1)
  ITL   inter-token latency: every gap between two consecutive text chunks
  E2EL  end-to-end latency: from sending the request to the end of its stream
Output tokens are the server's `usage.completion_tokens` (stream_options.include_usage), or the number
of text chunks when the server sends no usage. Prints vLLM's "Serving Benchmark Result" block per rate
and writes its numbers, with every per-request time, to one JSON file per rate. With --dashboards N, N
streams of our /dashboard/events stay open and read for each run (the dashboard's overhead).

Usage:
  python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --request-rate 1 2 4 inf \\
      --result-dir results/serving --label ours
  python scripts/bench_serving.py --duration 30 --request-rate 8 inf --max-concurrency 64  # 30 s per rate
  python scripts/bench_serving.py --plot latency.png results/serving/*.json   # only plots
  python scripts/bench_serving.py --dashboards 4 --label ours-dash4 ...      # with 4 dashboards open
"""

import argparse
import asyncio
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from bench_common import DEFAULT_WORKLOAD, Request, load_jsonl, run_info
from tqdm import tqdm


@dataclass
class RequestResult:
    """Timings of one request, in seconds; lengths in tokens. `error` is None when it succeeded."""

    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    error: str | None = None


async def send(client: httpx.AsyncClient, url: str, payload: dict, prompt_len: int) -> RequestResult:
    """Streams one completion and times its chunks (Server-Sent Events, `data: {...}` lines)."""
    res = RequestResult(prompt_len)
    usage, text_chunks, last = None, 0, 0.0
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if text_chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, text_chunks = now, text_chunks + 1
                usage = chunk.get("usage") or usage
        res.e2el = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{e.__class__.__name__}: {e}"
        return res
    if usage:
        res.prompt_len = usage.get("prompt_tokens", prompt_len)
        res.output_len = usage["completion_tokens"]
    else:
        res.output_len = text_chunks
    if res.output_len == 0:
        res.error = "no tokens in the response"
    return res


def payload_for(req: Request, model: str, ignore_eos: bool) -> dict:
    """The /v1/completions body: greedy, streamed, with usage in the last chunk. The prompt goes as text
    when the workload has it (every server takes text), else as token ids."""
    body = {
        "model": model,
        "prompt": req.prompt if req.prompt is not None else req.prompt_token_ids,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # a vLLM and llama.cpp extension: generate exactly max_tokens
        body["ignore_eos"] = True
    return body


async def watch_dashboard(client: httpx.AsyncClient, url: str, events: list[int], i: int) -> None:
    """Reads a /dashboard/events stream as a browser would, counting its events in `events[i]`."""
    async with client.stream("GET", url) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"{url}: HTTP {resp.status_code} (is the dashboard on, and the server open?)")
        async for line in resp.aiter_lines():
            events[i] += line.startswith("data:")


async def run_at_rate(
    args, url: str, model: str, reqs: list[Request], rate: float
) -> tuple[list[RequestResult], float, list[int]]:
    """Sends every request, Poisson arrivals at `rate` req/s, with `args.dashboards` dashboard streams
    open; returns the results in request order, the benchmark's wall time in seconds (first send to
    last response) and the events each dashboard stream received."""
    rng = np.random.default_rng(args.seed)
    if args.duration and not math.isinf(rate):  # the workload repeated for `duration` seconds of arrivals
        reqs = list(itertools.islice(itertools.cycle(reqs), math.ceil(rate * args.duration)))
    # Arrival times fixed up front, so a slow event loop delays requests but does not change the schedule.
    gaps = np.zeros(len(reqs)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(reqs))
    arrivals = np.cumsum(gaps) - gaps[0]
    limit = asyncio.Semaphore(args.max_concurrency or len(reqs))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # the default caps at 100
    events = [0] * args.dashboards
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        dashboard_url = args.base_url.rstrip("/") + "/dashboard/events"
        watchers = [
            asyncio.create_task(watch_dashboard(client, dashboard_url, events, i)) for i in range(args.dashboards)
        ]
        await asyncio.sleep(1.0 if watchers else 0.0)  # connected, first snapshot sent
        with tqdm(
            total=None if args.duration and math.isinf(rate) else len(reqs),
            desc=f"rate {rate}",
            unit="req",
            disable=args.disable_tqdm,
        ) as pbar:

            async def one(req: Request, at: float) -> RequestResult:
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                async with limit:
                    res = await send(client, url, payload_for(req, model, args.ignore_eos), len(req.prompt_token_ids))
                pbar.update(1)
                return res

            async def closed_loop(todo) -> list[RequestResult]:
                """One of max_concurrency clients: sends the next request as soon as its last one ended,
                until `duration` seconds have passed."""
                done = []
                while time.perf_counter() - start < args.duration:
                    req = next(todo)
                    done.append(
                        await send(client, url, payload_for(req, model, args.ignore_eos), len(req.prompt_token_ids))
                    )
                    pbar.update(1)
                return done

            start = time.perf_counter()
            if args.duration and math.isinf(rate):
                todo = itertools.cycle(reqs)
                clients = await asyncio.gather(*(closed_loop(todo) for _ in range(args.max_concurrency)))
                results = [r for done in clients for r in done]
            else:
                results = await asyncio.gather(*(one(r, t) for r, t in zip(reqs, arrivals)))
            duration = time.perf_counter() - start
        for task in watchers:
            if task.done():
                task.result()  # raises what ended it early
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        return results, duration, events


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    """vLLM's metrics: throughputs over the whole run, latencies (ms) over the successful requests;
    TPOT only over requests with more than one output token. Key names follow vLLM's result JSON."""
    ok = [r for r in results if r.error is None]
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": sum(r.output_len for r in ok),
    }
    out["request_throughput"] = len(ok) / duration
    out["output_throughput"] = out["total_output_tokens"] / duration
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration
    per_metric = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.e2el - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }
    for name, values in per_metric.items():
        ms = np.asarray(values or [0.0]) * 1000
        out[f"mean_{name}_ms"], out[f"median_{name}_ms"], out[f"std_{name}_ms"] = ms.mean(), np.median(ms), ms.std()
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = np.percentile(ms, p)
    out = {k: float(v) if isinstance(v, np.floating) else v for k, v in out.items()}
    out.update(
        input_lens=[r.prompt_len for r in ok],
        output_lens=[r.output_len for r in ok],
        ttfts=[r.ttft for r in ok],
        itls=[r.itl for r in ok],
        e2els=[r.e2el for r in ok],
        errors=[r.error for r in results if r.error],
    )
    return out


def print_result(s: dict, rate: float, max_concurrency: int | None, percentiles: list[float]):
    """Prints the block in vLLM's layout, so results can be read (and parsed) side by side with vLLM's."""

    def row(name, value):
        print(f"{name:<40} {value:<10}")

    print("{:=^50}".format(" Serving Benchmark Result "))
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    if max_concurrency:
        row("Maximum request concurrency:", max_concurrency)
    if not math.isinf(rate):
        row("Request rate configured (RPS):", f"{rate:.2f}")
    row("Benchmark duration (s):", f"{s['duration']:.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    row("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    for name, header in [
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ]:
        print("{:-^50}".format(header))
        row(f"Mean {name.upper()} (ms):", f"{s[f'mean_{name}_ms']:.2f}")
        row(f"Median {name.upper()} (ms):", f"{s[f'median_{name}_ms']:.2f}")
        for p in percentiles:
            row(f"P{p:g} {name.upper()} (ms):", f"{s[f'p{p:g}_{name}_ms']:.2f}")
    print("=" * 50)


def plot(paths: list[str], out: str):
    """Latency against achieved load (request throughput, req/s): one line per label, median solid and
    P99 dashed, one panel per metric. Reads result JSONs written by this script."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    runs: dict[str, list[dict]] = {}
    for p in paths:
        r = json.loads(Path(p).read_text())
        runs.setdefault(r["label"], []).append(r)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for ax, (name, title) in zip(axes.flat, [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")]):
        for label, rs in sorted(runs.items()):
            rs = sorted(rs, key=lambda r: r["request_throughput"])
            x = [r["request_throughput"] for r in rs]
            (line,) = ax.plot(x, [r[f"median_{name}_ms"] for r in rs], "o-", label=f"{label} median")
            if all("p99_" + name + "_ms" in r for r in rs):
                ax.plot(x, [r[f"p99_{name}_ms"] for r in rs], "s--", color=line.get_color(), label=f"{label} P99")
        ax.set_title(f"{title} (ms)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("request throughput (req/s)")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def served_model(base_url: str) -> str:
    """The first model the server lists at /v1/models (what `--model` defaults to)."""
    resp = httpx.get(f"{base_url}/v1/models", timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def safe(label: str) -> str:
    """A label as a file-name part: URL punctuation replaced."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


async def probe(url: str, payload: dict) -> RequestResult:
    """Sends one request on its own connection."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        return await send(client, url, payload, 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--model", help="model name to send (default: the first one at /v1/models)")
    ap.add_argument("--dataset", default=str(DEFAULT_WORKLOAD), help="JSONL workload (see scripts/bench_common.py)")
    ap.add_argument("--num-prompts", type=int, help="use the first N requests (default: all)")
    ap.add_argument("--output-len", type=int, help="override every request's max_tokens")
    ap.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[math.inf],
        help="requests/s of the Poisson arrivals, one run per value; inf = all at once",
    )
    ap.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    ap.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help="run each rate for S seconds, the workload repeated: Poisson arrivals for S seconds at a finite "
        "rate; at inf, --max-concurrency clients each sending its next request when the last ends",
    )
    ap.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly max_tokens tokens (vLLM/llama.cpp `ignore_eos`)",
    )
    ap.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    ap.add_argument("--label", help="name of this server in results and plots (default: the base URL)")
    ap.add_argument("--result-dir", help="write one JSON per rate here")
    ap.add_argument(
        "--plot", metavar="PNG", help="draw latency-vs-load curves to PNG (from RESULTS, else from this run's results)"
    )
    ap.add_argument("results", nargs="*", help="result JSONs to plot; with them, no benchmark is run")
    ap.add_argument(
        "--dashboards",
        type=int,
        default=0,
        metavar="N",
        help="keep N streams of the server's /dashboard/events open during each run (ours only)",
    )
    ap.add_argument("--disable-tqdm", action="store_true")
    args = ap.parse_args()
    if args.duration and math.inf in args.request_rate and not args.max_concurrency:
        ap.error("--duration at rate inf needs --max-concurrency")
    if args.results:
        if not args.plot:
            ap.error("result JSONs given without --plot")
        return plot(args.results, args.plot)

    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    base_url = args.base_url.rstrip("/")
    model = args.model or served_model(base_url)
    reqs = load_jsonl(args.dataset, args.num_prompts, args.output_len)
    url = base_url + args.endpoint
    # One short request first: fails fast on a wrong URL or model, and warms the server up.
    test = asyncio.run(
        probe(url, payload_for(Request(reqs[0].prompt_token_ids, 4, reqs[0].prompt), model, args.ignore_eos))
    )
    if test.error:
        raise SystemExit(f"test request to {url} failed: {test.error}")
    written = []
    for rate in args.request_rate:
        print(f"Traffic request rate: {rate}\nMaximum request concurrency: {args.max_concurrency}")
        results, duration, events = asyncio.run(run_at_rate(args, url, model, reqs, rate))
        summary = summarize(results, duration, percentiles)
        print_result(summary, rate, args.max_concurrency, percentiles)
        if args.dashboards:
            print(f"dashboards open: {args.dashboards}, events received each: {events}")
        if summary["errors"]:
            print(f"first error: {summary['errors'][0]}")
        expected = sum(r.max_tokens for r in reqs)
        if (
            args.ignore_eos
            and not args.duration
            and not summary["failed"]
            and summary["total_output_tokens"] != expected
        ):
            print(f"WARNING: the server generated {summary['total_output_tokens']} tokens, expected {expected}")
        if args.result_dir:
            label = args.label or base_url
            record = {
                **run_info(),
                "label": label,
                "base_url": base_url,
                "model": model,
                "dataset": args.dataset,
                "num_prompts": len(reqs),
                "request_rate": "inf" if math.isinf(rate) else rate,
                "max_concurrency": args.max_concurrency,
                "dashboards": args.dashboards,
                "dashboard_events": events,
                **summary,
            }
            path = Path(args.result_dir) / f"{safe(label)}-rate{rate:g}-conc{args.max_concurrency or 'none'}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record, indent=1))
            written.append(str(path))
            print(f"wrote {path}")
    if args.plot:
        if not written:
            ap.error("--plot after a run needs --result-dir (the curves are drawn from the JSONs)")
        plot(written, args.plot)


if __name__ == "__main__":
    main()
