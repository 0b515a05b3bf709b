"""How often two engine configurations pick the same greedy tokens: the share of a workload's requests
whose first --tokens output tokens are equal. The reference defaults to float32 activations on weights
dequantized at load (`--quantization none`), the path tests/engine/test_greedy_vs_hf.py holds equal to
transformers; the candidate defaults to what the engine runs by default (for a GGUF model: its quantized
weights, bfloat16 activations where the CPU has AVX512-BF16).

Usage:
  python scripts/check_agreement.py                          # default model, W64, first 16 tokens
  python scripts/check_agreement.py --model ~/.cache/minivllm/models/llama-1b-random/model-Q4_K_M.gguf
"""

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import LLM, SamplingParams  # noqa: E402

WORKLOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "workload.jsonl")


def greedy_tokens(prompts: list[list[int]], tokens: int, **engine_args) -> list[list[int]]:
    """First `tokens` greedy output token ids (EOS ignored) of each prompt, from a fresh engine."""
    llm = LLM(kv_cache_memory=512 << 20, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    gc.collect()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the default model's GGUF)")
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--ref-dtype", default="float32")
    p.add_argument("--ref-quantization", default="none")
    p.add_argument("--dtype", default="auto", help="candidate's activation dtype")
    p.add_argument("--quantization", default=None, help="candidate's weights (default: the model's own)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    with open(args.workload) as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f]
    ref = greedy_tokens(
        prompts, args.tokens, model=args.model, dtype=args.ref_dtype, quantization=args.ref_quantization
    )
    ours = greedy_tokens(prompts, args.tokens, model=args.model, dtype=args.dtype, quantization=args.quantization)
    same = sum(a == b for a, b in zip(ours, ref))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ours, ref)]
    print(
        f"first {args.tokens} greedy tokens equal to the reference ({args.ref_dtype}, quantization "
        f"{args.ref_quantization}): {same}/{len(ref)} requests = {same / len(ref):.1%}"
    )
    print("first differing position of the others:", sorted(i for i in first_diff if i is not None))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "tokens": args.tokens,
                    "requests": len(ref),
                    "equal": same,
                    "reference": {"dtype": args.ref_dtype, "quantization": args.ref_quantization},
                    "candidate": {"dtype": args.dtype, "quantization": args.quantization},
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
