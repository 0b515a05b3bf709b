"""Answer one chat prompt with the default model (or --model).

python scripts/generate.py "What is the capital of France?"
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import LLM, SamplingParams  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", nargs="?", default="What is the capital of France?")
    ap.add_argument("--model", default=None, help="HF directory, hub id in the local cache, or .gguf file")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    llm = LLM(model=args.model, kv_cache_memory=256 << 20)
    out = llm.chat(
        [{"role": "user", "content": args.prompt}],
        SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens),
        use_tqdm=False,
    )
    print(out[0].outputs[0].text)


if __name__ == "__main__":
    main()
