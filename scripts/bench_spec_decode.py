"""What speculative decoding buys: output tokens/s and ms per output token with and without it, on
a workload where prompt lookup pays (scripts/data/copy_workload.jsonl: answers that copy passages
and functions of the prompt) and on W64 (scripts/data/workload.jsonl, no copying) as the control,
at batch sizes 1, 8 and 64 (max_num_seqs; the first --num-requests requests of the workload, all
queued at once), with the mean acceptance length (1 + accepted / drafts, vLLM's) and acceptance rate.

Two engines live in one process, one with --speculative-config and one without, and alternate
within each of --repeats rounds (the machine's speed drifts); the table reports medians. Every
request produces exactly its max_tokens (greedy, EOS ignored), as in the other benchmarks; "same"
is the share of requests whose tokens equal the run without speculation (lossless: 100% in
float32; bfloat16 rounding can differ between a 1-token and a (1 + k)-token row at near-ties).
ms/token is the mean over requests of (last token - first token) / (tokens - 1), the TPOT.

With --with-vllm the same rounds run vLLM's CPU build (the venv made by ../shared/peers/vllm_cpu.sh)
with its own ngram config in a subprocess per measurement; if vLLM refuses, its error is reported.

Usage:
  python scripts/bench_spec_decode.py --dtype bfloat16 --repeats 3 --output-json results/spec_decode.json
  python scripts/bench_spec_decode.py --dtype bfloat16 --repeats 3 --with-vllm
  python scripts/bench_spec_decode.py --batch-sizes 1 --num-requests 2 --output-len 32 --repeats 1   # smoke
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
WORKLOADS = {
    "copy": os.path.join(HERE, "data", "copy_workload.jsonl"),
    "w64": os.path.join(HERE, "data", "workload.jsonl"),
}
REQUESTS_PER_BATCH = {1: 8, 8: 32, 64: 64}  # default number of requests at each batch size
VLLM_PYTHON = os.environ.get("VLLM_VENV", "/tmp/venv-vllm-cpu") + "/bin/python"


def run_ours(llm, reqs, batch_size: int) -> dict:
    """Runs `reqs` (bench_common.Request) with at most `batch_size` running; returns tokens, seconds,
    mean TPOT (s), the outputs and the speculation counters of this run."""
    from engine import SamplingParams

    engine = llm.engine
    llm.reset_prefix_cache()
    engine.engine_core.scheduler.max_num_seqs = batch_size
    before = engine.stats().spec_decoding
    start = time.perf_counter()
    ids = [
        engine.add_request(
            None, r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        )
        for r in reqs
    ]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    elapsed = time.perf_counter() - start
    outs = [final[i] for i in ids]
    tpots = [
        (o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for o in outs
        if len(o.outputs[0].token_ids) > 1
    ]
    result = {
        "elapsed_s": elapsed,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "tpot_s": statistics.mean(tpots) if tpots else None,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }
    after = engine.stats().spec_decoding
    if after is not None:
        result |= {
            "drafts": after.num_drafts - before.num_drafts,
            "draft_tokens": after.num_draft_tokens - before.num_draft_tokens,
            "accepted": after.num_accepted_tokens - before.num_accepted_tokens,
        }
    return result


def run_vllm(model_dir: str, dtype: str, reqs, batch_size: int, spec: str | None) -> dict:
    """One vLLM-CPU process running `reqs` (after a 2-request warm-up); the result of `vllm_driver`,
    or {"error": its last line} when vLLM fails."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
        for r in reqs:
            f.write(json.dumps({"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}) + "\n")
        f.flush()
        cmd = [
            VLLM_PYTHON,
            os.path.abspath(__file__),
            "--vllm-driver",
            "--model",
            model_dir,
            "--dtype",
            dtype,
            "--workload",
            f.name,
            "--max-num-seqs",
            str(batch_size),
            "--speculative-config",
            spec or "",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        # the exception's line, not the warnings that follow it at shutdown
        err = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line] or [
            line for line in proc.stderr.splitlines() if line.strip()
        ]
        return {"error": err[-1].strip()[:300] if err else f"exit {proc.returncode}"}
    return json.loads(lines[-1])


def vllm_driver(args) -> None:
    """Runs inside vLLM's venv: LLM(...) with the speculative config, one timed generate; prints JSON."""
    for k, v in {
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    }.items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams

    reqs = [json.loads(line) for line in open(args.workload) if line.strip()]
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        seed=0,
        max_num_seqs=args.max_num_seqs,
        speculative_config=spec,
        disable_log_stats=False,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], min_tokens=r["max_tokens"], ignore_eos=True)
        for r in reqs
    ]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    counters = _vllm_spec_counters(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tpots = [
        (o.metrics.last_token_ts - o.metrics.first_token_ts) / (len(o.outputs[0].token_ids) - 1)
        for o in outs
        if getattr(o, "metrics", None) is not None and len(o.outputs[0].token_ids) > 1
    ]
    after = _vllm_spec_counters(llm)
    result = {
        "elapsed_s": elapsed,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "tpot_s": statistics.mean(tpots) if tpots else None,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }
    if spec:
        result |= {k: after[k] - counters[k] for k in after}
    print(json.dumps(result))


def _vllm_spec_counters(llm) -> dict:
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    out = dict.fromkeys(names.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += getattr(metric, "value", 0)
    return out


def summarize(runs: list[dict], base_tokens: list[list[int]] | None) -> dict:
    """Medians over rounds of output tok/s and ms/token, plus acceptance and the share equal to base."""
    if any("error" in r for r in runs):
        return {"error": next(r["error"] for r in runs if "error" in r)}
    row = {
        "output_tok_s": statistics.median(r["output_tokens"] / r["elapsed_s"] for r in runs),
        "runs_tok_s": [round(r["output_tokens"] / r["elapsed_s"], 1) for r in runs],
    }
    tpots = [r["tpot_s"] for r in runs if r["tpot_s"] is not None]
    row["ms_per_token"] = 1000 * statistics.median(tpots) if tpots else None
    drafts = sum(r.get("drafts", 0) for r in runs)
    if "drafts" in runs[0]:
        row["mean_acceptance_length"] = 1 + sum(r["accepted"] for r in runs) / drafts if drafts else None
        row["acceptance_rate"] = sum(r["accepted"] for r in runs) / max(sum(r["draft_tokens"] for r in runs), 1)
    if base_tokens is not None:
        row["same"] = sum(a == b for a, b in zip(runs[-1]["tokens"], base_tokens)) / len(base_tokens)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["copy", "w64"], choices=list(WORKLOADS))
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--num-requests", type=int, help="requests per measurement (default: 8, 32, 64 at batch 1, 8, 64)")
    ap.add_argument("--output-len", type=int, help="override every request's max_tokens (default: 128)")
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC, help="JSON, vLLM's keys (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--kv-cache-memory", default="1G", help="each engine's KV cache, e.g. 512M, 1G")
    ap.add_argument("--with-vllm", action="store_true", help="also run vLLM-CPU with and without its ngram config")
    ap.add_argument("--output-json")
    ap.add_argument("--vllm-driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--max-num-seqs", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_driver:
        return vllm_driver(args)

    sys.path.insert(0, os.path.dirname(HERE))  # the repository root
    sys.path.insert(0, HERE)
    from bench_common import load_jsonl, run_info

    from api.cli import byte_size
    from engine import LLM

    spec_config = json.loads(args.speculative_config)
    common = dict(dtype=args.dtype, kv_cache_memory=byte_size(args.kv_cache_memory), max_num_seqs=max(args.batch_sizes))
    engines = {"ours": LLM(**common), "ours+spec": LLM(speculative_config=spec_config, **common)}
    model_dir = engines["ours"].model_dir
    warmup = load_jsonl(WORKLOADS["w64"], 2, 8)
    for llm in engines.values():
        run_ours(llm, warmup, 2)
    results = []
    for workload in args.workloads:
        for batch_size in args.batch_sizes:
            n = args.num_requests or REQUESTS_PER_BATCH.get(batch_size, 2 * batch_size)
            reqs = load_jsonl(WORKLOADS[workload], n, args.output_len)
            runs = {name: [] for name in engines}
            if args.with_vllm:
                runs |= {"vllm": [], "vllm+spec": []}
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    runs[name].append(run_ours(llm, reqs, batch_size))
                if args.with_vllm:
                    runs["vllm"].append(run_vllm(model_dir, args.dtype, reqs, batch_size, None))
                    runs["vllm+spec"].append(run_vllm(model_dir, args.dtype, reqs, batch_size, args.speculative_config))
                for name, engine_runs in runs.items():  # progress, as the runs are long
                    r = engine_runs[-1]
                    rate = r.get("error") or f"{r['output_tokens'] / r['elapsed_s']:.1f} output tok/s"
                    print(f"{workload} batch {batch_size} {name}: {rate}", file=sys.stderr, flush=True)
            for name, engine_runs in runs.items():
                base = runs[name.removesuffix("+spec")][-1] if name.endswith("+spec") else None
                row = summarize(engine_runs, base.get("tokens") if base and "error" not in base else None)
                results.append({"workload": workload, "batch_size": batch_size, "requests": n, "engine": name, **row})
    print_table(results)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({**run_info(), "args": vars(args), "results": results}, f, indent=1)
        print(f"wrote {args.output_json}")


def print_table(results: list[dict]) -> None:
    base = {(r["workload"], r["batch_size"], r["engine"]): r for r in results}
    print(
        "| workload | batch | requests | engine | output tok/s | ms/token | speed-up | mean acceptance length | "
        "acceptance rate | same tokens | all runs (tok/s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['workload']} | {r['batch_size']} | {r['requests']} | {r['engine']} | error: {r['error']} |")
            continue
        ref = base.get((r["workload"], r["batch_size"], r["engine"].removesuffix("+spec")))
        speedup = r["output_tok_s"] / ref["output_tok_s"] if ref and "error" not in ref else None
        cells = [
            r["workload"],
            r["batch_size"],
            r["requests"],
            r["engine"],
            f"{r['output_tok_s']:.1f}",
            _fmt(r.get("ms_per_token"), ".1f"),
            _fmt(speedup, ".2f", "×") if r["engine"].endswith("+spec") else "",
            _fmt(r.get("mean_acceptance_length"), ".2f"),
            _fmt(r.get("acceptance_rate"), ".0%"),
            _fmt(r.get("same"), ".0%"),
            " ".join(map(str, r["runs_tok_s"])),
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


if __name__ == "__main__":
    main()
