"""Batch-1 decode latency of vLLM's CPU build: run inside its venv by `bench_peers.py --latency --with-vllm`.

Each prompt runs alone, first for 1 output token, then for --max-tokens (greedy, EOS ignored), with the
prefix cache reset before each run; ms per output token = (t(N) - t(1)) / (N - 1), so prefill and
per-request overheads cancel. Prints one JSON line: {"ms_per_token": [one per prompt and repeat]}.

    /tmp/venv-vllm-cpu/bin/python scripts/vllm_latency.py --model DIR --prompts prompts.jsonl --max-tokens 64
"""

import argparse
import json
import os
import time

for k, v in {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
}.items():
    os.environ.setdefault(k, v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", required=True, help="JSONL with prompt_token_ids")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()
    from vllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": json.loads(line)["prompt_token_ids"]} for line in open(a.prompts) if line.strip()]
    llm = LLM(model=a.model, dtype=a.dtype, enforce_eager=True, seed=0, max_num_seqs=1)

    def run(prompt, n):
        llm.reset_prefix_cache()
        sp = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        return time.perf_counter() - start

    run(prompts[0], 4)  # warm-up
    ms = []
    for _ in range(a.repeats):
        for p in prompts:
            ms.append(1e3 * (run(p, a.max_tokens) - run(p, 1)) / (a.max_tokens - 1))
    print(json.dumps({"engine": "vllm-cpu", "ms_per_token": ms}))


if __name__ == "__main__":
    main()
