"""Perplexity of a model on a fixed English text, by llama.cpp's `llama-perplexity` method: the text's tokens
cut into non-overlapping chunks of --ctx tokens, each chunk a prompt on its own, and only the second half of
each chunk scored (every scored token has at least ctx / 2 tokens of context). The text is the prompts of
scripts/data/workload.jsonl (license texts), joined. Prompt logprobs come from the engine
(`SamplingParams(prompt_logprobs=0)`), so whatever changes the arithmetic (`--kv-cache-dtype`, `--dtype`,
`--quantization`) changes the figure; the prefix cache is off, so every chunk is computed. With
`--max-num-batched-tokens 8` the chunks go through the engine 8 tokens a step, so the kernels that decode
(few rows at a time) compute them.

    python scripts/perplexity.py                                   # the default model, its Q4_1 weights
    python scripts/perplexity.py --kv-cache-dtype int8 --tokens 20480
"""

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from engine import LLM, SamplingParams  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "workload.jsonl")


def perplexity(llm: LLM, ctx: int, tokens: int) -> tuple[float, int]:
    """(perplexity, tokens scored) over the first `tokens` tokens of the text, in chunks of `ctx`."""
    with open(DATA) as f:
        text = "\n\n".join(json.loads(line)["prompt"] for line in f)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)[:tokens]
    chunks = [ids[i : i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]
    if not chunks:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    nll, n = 0.0, 0
    for out in llm.generate(chunks, params, use_tqdm=False):
        for pos in range(ctx // 2, ctx):  # the entry at pos is the log-probability of token pos
            nll -= out.prompt_logprobs[pos].logprob
            n += 1
    return math.exp(nll / n), n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="default: SmolLM2-135M-Instruct (its Q4_1 GGUF)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity's -c)")
    ap.add_argument("--tokens", type=int, default=20480, help="tokens of the text to use")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", choices=["gguf", "none"])
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per step: 8 or fewer computes every chunk with the few-row (decode) kernels",
    )
    args = ap.parse_args()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        enable_prefix_caching=False,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    start = time.perf_counter()
    ppl, n = perplexity(llm, args.ctx, args.tokens)
    print(
        json.dumps(
            {
                "model": llm.model_dir,
                "dtype": args.dtype,
                "kv_cache_dtype": args.kv_cache_dtype,
                "ctx": args.ctx,
                "tokens_scored": n,
                "perplexity": round(ppl, 4),
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
