"""Where an engine step's time goes, on the default workload.

Times every part of `LLMEngine.step()` by wrapping the engine's own methods (no engine changes):
scheduling, input preparation (tensors, block tables, slot mapping), model forward split into
attention (the backend's forward: KV write + attention) and the rest (matmuls, norms, activations),
the LM head, sampling, and output processing (detokenization, stop checks, RequestOutputs). Steps
are reported separately as decode-only steps at full batch and mixed/prefill steps, with the engine
overhead (everything but the model forward and LM head) as a share of step time. A short
torch.profiler run over decode steps gives the share of aten::mm.

    python scripts/profile_step.py [--dtype bfloat16] [--num-requests 64] [--model M]
"""

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench_common import DEFAULT_WORKLOAD, load_jsonl  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.worker.host_memory import wait_for_prefault  # noqa: E402

PARTS = ["schedule", "prepare", "attention", "forward", "lm_head", "sampling", "step"]


def timed(fn, totals, name):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--model", default=None, help="a model directory or GGUF file (default: the default model)")
    args = ap.parse_args()
    reqs = load_jsonl(DEFAULT_WORKLOAD, args.num_requests, args.output_len)
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory=2 << 30)
    wait_for_prefault()  # until the KV cache is mapped, its prefault thread takes a core: steps ran 3x slower
    eng, runner = llm.engine, llm.engine.engine_core.executor.runner
    sched = eng.engine_core.scheduler
    llm.generate([r.prompt_token_ids for r in reqs[:2]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()

    step_totals = collections.defaultdict(float)
    sched.schedule = timed(sched.schedule, step_totals, "schedule")
    runner.input_batch.prepare = timed(runner.input_batch.prepare, step_totals, "prepare")
    runner.backend.forward = timed(runner.backend.forward, step_totals, "attention")
    runner.model.forward = timed(runner.model.forward, step_totals, "forward")
    runner.model.compute_logits = timed(runner.model.compute_logits, step_totals, "lm_head")
    runner.sampler = timed(runner.sampler, step_totals, "sampling")
    step = timed(eng.step, step_totals, "step")

    for r in reqs:
        eng.add_request(
            None, r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        )
    kinds = {"decode": collections.defaultdict(float), "mixed/prefill": collections.defaultdict(float)}
    steps = collections.Counter()
    while eng.has_unfinished_requests():
        full_decode = (
            not sched.waiting
            and len(sched.running) == len(reqs)
            and all(r.num_computed_tokens == r.num_tokens - 1 for r in sched.running)
        )
        step_totals.clear()
        step()
        kind = "decode" if full_decode else "mixed/prefill"
        steps[kind] += 1
        for k, v in step_totals.items():
            kinds[kind][k] += v

    print(f"{len(reqs)} requests, {args.dtype}, {torch.get_num_threads()} threads; milliseconds per step")
    print(f"{'part':<34}" + "".join(f"{k:>22}" for k in kinds))
    rows = [
        ("scheduling", ["schedule"]),
        ("input preparation", ["prepare"]),
        ("model forward: attention", ["attention"]),
        ("model forward: rest (matmuls, ...)", ["forward", "-attention"]),
        ("LM head", ["lm_head"]),
        ("sampling", ["sampling"]),
        (
            "output processing (detokenize, stops)",
            ["step", "-schedule", "-prepare", "-forward", "-lm_head", "-sampling"],
        ),
        ("total step", ["step"]),
    ]
    for label, terms in rows:
        cells = []
        for kind, t in kinds.items():
            v = sum(-t[x[1:]] if x.startswith("-") else t[x] for x in terms) / max(steps[kind], 1)
            cells.append(f"{1000 * v:10.2f} ({100 * v * steps[kind] / max(t['step'], 1e-9):4.1f}%)")
        print(f"{label:<34}" + "".join(f"{c:>22}" for c in cells))
    fused = sum(bool(getattr(layer, "fused", None)) for layer in getattr(runner.model, "layers", []))
    if fused:
        how = "all in one C call" if getattr(runner.model, "fused_stack", None) else "as one C call each"
        print(
            f"{fused} layers run {how} (models/layers/fused_layer.py) on steps they take: their "
            "attention is inside 'rest', not in the attention row"
        )
    for kind, t in kinds.items():
        overhead = t["step"] - t["forward"] - t["lm_head"]
        print(
            f"{kind}: {steps[kind]} steps; engine overhead outside the model forward and LM head: "
            f"{100 * overhead / max(t['step'], 1e-9):.1f}% of step time"
        )

    # aten-level split of full-batch decode steps
    for r in reqs:
        eng.add_request(None, r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        eng.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::linear"))
    print(
        f"torch.profiler over 3 decode steps at batch {len(reqs)}: aten::mm is {100 * mm / total:.0f}% of the "
        f"aten time ({mm / 3e3:.1f} ms/step); the C decode-attention kernel is outside aten"
    )


if __name__ == "__main__":
    main()
