"""Batch-1 decode of two engine variants in one process, alternating, so that a change is measured in the same
minutes on the same host (this project's VMs move by up to 25% between runs; a second engine loaded into a process
also ran 10-15% faster than the first one in 4 KiB pages, so the variants' load order is given and swappable).

Variants (--ab):
  huge-pages  the weights moved into transparent huge pages (engine/worker/host_memory.py) against left where they
              were loaded (both KV caches in huge pages);
  stack       the fused layers as one C call per step (FusedDecoderStack) against one call per layer, in one engine;
  fused       the layers in C (the stack, as by default) against op by op (every layer's fused form off), in one
              engine;
  dtype       --dtype bfloat16 against float32.

Each round runs every variant once (the order reversed every other round): --prompts prompts of --depth tokens
(the prefix cache keeps them: a round times the decode), --output-len tokens each, greedy, EOS ignored. Prints the
ms per output token of every round and the median and best of each variant, one JSON line.

    OMP_NUM_THREADS=2 taskset -c 0,1 python scripts/bench_batch1_ab.py --ab huge-pages
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402
from engine.worker import host_memory  # noqa: E402


def engines(ab: str, model: str | None, dtype: str, swap: bool) -> dict:
    """{variant name: (LLM, a function that turns the variant on before a round)} for `ab`."""
    kw = dict(model=model, kv_cache_memory=512 << 20)
    if ab == "dtype":
        names = ["bfloat16", "float32"][:: -1 if swap else 1]
        return {name: (LLM(dtype=name, **kw), lambda: None) for name in names}
    if ab == "huge-pages":
        moved, out = host_memory.huge_page_weights, {}
        for name in ["huge pages", "4 KiB pages"][:: -1 if swap else 1]:
            host_memory.huge_page_weights = moved if name == "huge pages" else (lambda model: 0)
            out[name] = (LLM(dtype=dtype, **kw), lambda: None)
        host_memory.huge_page_weights = moved
        return out
    llm = LLM(dtype=dtype, **kw)
    model_ = llm.engine.engine_core.executor.runner.model
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # builds the stack
    stack = model_.fused_stack
    if not stack:
        sys.exit("this model's layers do not run as a fused stack")

    fused = [layer.fused for layer in model_.layers]

    def use(on: bool, layers_on: bool = True):
        def turn():
            model_.fused_stack = stack if on else False
            for layer, f in zip(model_.layers, fused):
                layer.fused = f if layers_on else False

        return turn

    if ab == "fused":
        out = {"fused": (llm, use(True)), "op by op": (llm, use(False, layers_on=False))}
    else:
        out = {"stack": (llm, use(True)), "one call per layer": (llm, use(False))}
    return dict(reversed(out.items())) if swap else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ab", required=True, choices=["huge-pages", "stack", "fused", "dtype"])
    ap.add_argument("--model", help="a model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--swap", action="store_true", help="load (and run first) the other variant first")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--depth", type=int, default=434)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    variants = engines(args.ab, args.model, args.dtype, args.swap)
    host_memory.wait_for_prefault()
    prompts = [[1000 + 7 * i + j for j in range(args.depth)] for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    for llm, use in variants.values():  # warm-up: the prompts into the prefix cache
        use()
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            llm, use = variants[name]
            use()
            start = time.perf_counter()
            for p in prompts:
                llm.generate([p], params, use_tqdm=False)
            times[name].append(1e3 * (time.perf_counter() - start) / (args.output_len * len(prompts)))
            print(f"round {r + 1}/{args.rounds}  {name:<20} {times[name][-1]:.2f} ms/token", flush=True)
    summary = {
        name: {"median_ms": round(sorted(t)[len(t) // 2], 3), "best_ms": round(min(t), 3)} for name, t in times.items()
    }
    print(json.dumps({"ab": args.ab, "dtype": args.dtype, "swap": args.swap, **summary}))


if __name__ == "__main__":
    main()
