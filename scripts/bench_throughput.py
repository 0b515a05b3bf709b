"""Offline throughput of the engine through its Python API, as vLLM's `vllm bench throughput` measures it.

All requests are queued at once and the engine runs until every one has produced exactly its
max_tokens (EOS ignored, greedy). Prints requests/s and input, output and total tokens/s over the wall
time, the peak KV-cache usage (sampled after every engine step) and the prefix-cache hit rate (prompt
tokens found in the cache / prompt tokens looked up), and writes them as JSON with --output-json.

With --structured json every request is constrained to a JSON schema (structured outputs, EOS honoured,
so requests end when their JSON does or at max_tokens); the same requests run unconstrained first (also
EOS honoured), and the script prints both throughputs, their ratio and the per-step cost of filling and
applying the grammar bitmask (timed around the sampler's mask call).

Usage:
  python scripts/bench_throughput.py                                    # scripts/data/workload.jsonl
  python scripts/bench_throughput.py --structured json                  # W64, JSON schema on every request
  python scripts/bench_throughput.py --dataset scripts/data/prefix_workload.jsonl [--no-enable-prefix-caching]
  python scripts/bench_throughput.py --dataset random --num-prompts 64 --input-len 256 --output-len 128
  python scripts/bench_throughput.py --dtype float32 --tensor-parallel-size 3       # 3 processes
  python scripts/bench_throughput.py --pipeline-parallel-size 2 [--batches-in-flight 1]  # 2 stages
"""

import argparse
import dataclasses
import json
import os
import sys
import time

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench_common import DEFAULT_WORKLOAD, load_jsonl, random_requests, run_info  # noqa: E402

import engine.sample.rejection_sampler  # noqa: E402
from api.cli import byte_size  # noqa: E402
from engine import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

# --structured json: a record with nested objects, an array, an enum and bounded numbers
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "summary": {"type": "string"},
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "keywords": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "author": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
            "required": ["name"],
        },
    },
    "required": ["title", "summary", "sentiment", "score", "keywords"],
}


def run(
    llm, reqs, use_tqdm: bool = True, ignore_eos: bool = True, structured: StructuredOutputsParams | None = None
) -> dict:
    """Runs `reqs` through the engine's step loop (what `LLM.generate` does), reading the engine's
    stats after every step. Returns token counts, wall time (s), peak KV usage (0..1) and the prefix-cache
    counters of this run."""
    engine = llm.engine
    before = engine.stats()
    peak_kv, finished, output_tokens = 0.0, 0, 0
    cpu_before = rank_cpu_seconds(llm)
    start = time.perf_counter()
    for r in reqs:
        engine.add_request(
            None,
            r.prompt_token_ids,
            SamplingParams(
                temperature=0.0, max_tokens=r.max_tokens, ignore_eos=ignore_eos, structured_outputs=structured
            ),
        )
    with tqdm(total=len(reqs), desc="requests", disable=not use_tqdm) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished += 1
                    output_tokens += len(out.outputs[0].token_ids)
                    bar.update(1)
            peak_kv = max(peak_kv, engine.stats().kv_cache_usage)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    cpu = [b - a for a, b in zip(cpu_before, rank_cpu_seconds(llm))]
    return {
        "rank_busy": [c / elapsed for c in cpu],
        "elapsed_s": elapsed,
        "num_requests": finished,
        "input_tokens": sum(len(r.prompt_token_ids) for r in reqs),
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.max_tokens for r in reqs),
        "peak_kv_cache_usage": peak_kv,
        "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
        "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "ignore_eos": ignore_eos,
    }


def rank_cpu_seconds(llm) -> list[float]:
    """CPU seconds used so far by each rank's process: this one (rank 0), then the others on this host (from
    /proc). With one thread per rank and gloo waiting in epoll, CPU time over wall time is how busy each rank
    (each pipeline stage) is; 1 minus it, its bubble."""
    workers = getattr(llm.engine.engine_core.executor, "workers", None)
    seconds = [time.process_time()]
    for proc in workers.procs if workers is not None else []:
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        seconds.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))  # utime + stime
    return seconds


def report(m: dict) -> dict:
    """Adds the rates (per second of wall time) to a `run` result and prints them."""
    t = m["elapsed_s"]
    m["requests_per_s"] = m["num_requests"] / t
    m["input_tok_per_s"] = m["input_tokens"] / t
    m["output_tok_per_s"] = m["output_tokens"] / t
    m["total_tok_per_s"] = (m["input_tokens"] + m["output_tokens"]) / t
    m["prefix_cache_hit_rate"] = m["prefix_cache_hits"] / max(m["prefix_cache_queries"], 1)

    def row(name, value):
        print(f"{name:<40} {value:<10}")

    print("{:=^50}".format(" Offline Throughput Result "))
    row("Successful requests:", m["num_requests"])
    row("Elapsed time (s):", f"{t:.2f}")
    row("Total input tokens:", m["input_tokens"])
    row("Total generated tokens:", m["output_tokens"])
    row("Request throughput (req/s):", f"{m['requests_per_s']:.2f}")
    row("Input token throughput (tok/s):", f"{m['input_tok_per_s']:.2f}")
    row("Output token throughput (tok/s):", f"{m['output_tok_per_s']:.2f}")
    row("Total token throughput (tok/s):", f"{m['total_tok_per_s']:.2f}")
    row("Peak KV cache usage (%):", f"{100 * m['peak_kv_cache_usage']:.1f}")
    row("Prefix cache hit rate (%):", f"{100 * m['prefix_cache_hit_rate']:.1f}")
    row("Preemptions:", m["num_preemptions"])
    if len(m["rank_busy"]) > 1:
        row("CPU busy per rank (%):", " ".join(f"{100 * b:.0f}" for b in m["rank_busy"]))
    print("=" * 50)
    if m["ignore_eos"] and m["output_tokens"] != m["expected_output_tokens"]:
        print(f"WARNING: generated {m['output_tokens']} tokens, expected {m['expected_output_tokens']}")
    return m


def run_structured(llm, reqs, use_tqdm: bool) -> dict:
    """The requests unconstrained, then each constrained to BENCH_SCHEMA (greedy, EOS honoured both
    times); prints both results, the throughput ratio and the grammar mask's cost per step."""
    spec = StructuredOutputsParams(json=BENCH_SCHEMA)
    llm.engine.structured.compile_and_wait([spec])  # the compile is not what is measured
    print("unconstrained:")
    plain = report(run(llm, reqs, use_tqdm, ignore_eos=False))
    llm.reset_prefix_cache()
    mask_calls = []  # (seconds, constrained rows) of every step's mask fill + apply
    structured, sampler_module = llm.engine.structured, engine.sample.rejection_sampler
    fill, apply = structured.grammar_bitmask, sampler_module.apply_token_bitmask

    def timed_fill(requests, scheduler_output):
        t = time.perf_counter()
        grammar_output = fill(requests, scheduler_output)
        rows = len(grammar_output.structured_output_request_ids) if grammar_output is not None else 0
        mask_calls.append([time.perf_counter() - t, rows])
        return grammar_output

    def timed_apply(logits, bitmask, rows):
        t = time.perf_counter()
        apply(logits, bitmask, rows)
        mask_calls[-1][0] += time.perf_counter() - t

    structured.grammar_bitmask, sampler_module.apply_token_bitmask = timed_fill, timed_apply
    try:
        print("constrained to a JSON schema:")
        constrained = report(run(llm, reqs, use_tqdm, ignore_eos=False, structured=spec))
    finally:
        structured.grammar_bitmask, sampler_module.apply_token_bitmask = fill, apply
    full = [t for t, rows in mask_calls if rows >= 0.9 * len(reqs)] or [t for t, _ in mask_calls]
    ratio = constrained["output_tok_per_s"] / plain["output_tok_per_s"]
    mask_ms = 1e3 * sum(full) / len(full)
    steps_s = constrained["elapsed_s"] / max(len(mask_calls), 1)
    print(f"{'Constrained / unconstrained output tok/s:':<40} {100 * ratio:.1f}%")
    print(
        f"{'Mask fill+apply per step, full batch (ms):':<40} {mask_ms:.2f}  ({max(r for _, r in mask_calls)} rows; "
        f"{100 * mask_ms / 1e3 / steps_s:.1f}% of a mean step)"
    )
    return {
        "unconstrained": plain,
        "structured": constrained,
        "output_tok_per_s_ratio": ratio,
        "mask_ms_per_full_step": mask_ms,
        "mask_steps": len(mask_calls),
    }


def add_engine_args(ap: argparse.ArgumentParser):
    """The EngineConfig fields a benchmark varies, with vLLM's flag names; None = the engine's default."""
    ap.add_argument("--model", help="HF directory, .gguf or local hub id (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--kv-cache-memory", type=byte_size, help="KV-cache size, e.g. 268435456, 256M or 2G")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument(
        "--num-threads", type=int, help="torch CPU threads per rank (default: the cores / tensor-parallel size)"
    )
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, help="ranks the model is split over (default: 1)")
    ap.add_argument("--pipeline-parallel-size", "-pp", type=int, help="stages the layers are split into (default: 1)")
    ap.add_argument("--pp-layer-partition", help="each stage's number of layers, e.g. 19,11 (default: even)")
    ap.add_argument(
        "--quantization", choices=["gguf", "none"], help="a GGUF's weights kept quantized or dequantized at load"
    )


def engine_kwargs(args) -> dict:
    """The LLM(...) keyword arguments set on the command line."""
    names = [
        "dtype",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "kv_cache_memory",
        "enable_prefix_caching",
        "num_threads",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "pp_layer_partition",
        "quantization",
    ]
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def limit_batches_in_flight(llm, n: int) -> None:
    """Makes the engine keep at most n steps in flight (each taking max_num_seqs / n requests) instead of one
    per pipeline stage: the comparison the batch queue is measured by (not an engine option)."""
    core = llm.engine.engine_core
    core.executor.max_concurrent_batches = n
    core.scheduler.pipelined = n > 1
    core.scheduler.max_batch_seqs = -(-core.scheduler.max_num_seqs // n)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default=str(DEFAULT_WORKLOAD), help="JSONL workload, or 'random'")
    ap.add_argument("--num-prompts", type=int, help="first N requests of the JSONL (random: default 64)")
    ap.add_argument("--input-len", type=int, default=256, help="random: prompt tokens per request")
    ap.add_argument(
        "--output-len",
        type=int,
        help="tokens to generate per request (random: default 128; JSONL: overrides max_tokens)",
    )
    ap.add_argument("--seed", type=int, default=0, help="random: seed of the prompts")
    ap.add_argument("--output-json", help="write the config and results here")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument(
        "--structured",
        choices=["json"],
        help="compare with every request constrained to a JSON schema (EOS honoured in both runs)",
    )
    ap.add_argument(
        "--batches-in-flight",
        type=int,
        help="with pipeline stages, steps in flight at once (default: one per stage; 1 shows the pipeline's bubble)",
    )
    add_engine_args(ap)
    args = ap.parse_args()

    llm = LLM(model=args.model, **engine_kwargs(args))
    if args.batches_in_flight is not None:
        limit_batches_in_flight(llm, args.batches_in_flight)
    if args.dataset == "random":
        reqs = random_requests(args.num_prompts or 64, args.input_len, args.output_len or 128, llm.tokenizer, args.seed)
    else:
        reqs = load_jsonl(args.dataset, args.num_prompts, args.output_len)
    # Warm-up on prompts outside the workload (random tokens), so the timed run starts with no
    # workload prompt in the prefix cache but with the model's first-call costs paid.
    run(llm, random_requests(2, 64, 4, llm.tokenizer, seed=args.seed + 1), use_tqdm=False)
    if args.structured:
        metrics = run_structured(llm, reqs, use_tqdm=not args.disable_tqdm)
    else:
        metrics = report(run(llm, reqs, use_tqdm=not args.disable_tqdm))
    if args.output_json:
        record = {**run_info(), "args": vars(args), "engine_config": dataclasses.asdict(llm.engine.config), **metrics}
        with open(args.output_json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
