"""The engine and the server on CUDA, end to end, in one call on a GPU machine (gpu_check.py checks the pieces).

The model: scripts/make_1b_model.py's random Llama-3.2-1B shape (16 layers, hidden 2048, 32/8 heads of 64,
SmolLM2's 49,152-token vocabulary), written on the device from a fixed seed, so that only the tokenizer
travels (`.gpu/tokenizer`, 3.5 MB, written here from the default GGUF with --write-tokenizer).

(1) References: transformers on the same device, float32 and bfloat16, greedy, 32 tokens per prompt, one
prompt at a time, with the gap between the top two logits at every step. bfloat16's noise is measured as
the largest difference between the two references' logits at each prompt's first generated position.
(2) `LLM(...)` on 16 prompts (12 of the benchmark workload, 64-512 tokens; 1,500 and 2,000 random tokens;
a 300-token prompt, then one that shares its first 256 tokens): 14 at once with 512 tokens per step (the
long ones prefilled in chunks beside decodes) and 200 KV blocks (num_gpu_blocks_override), so that the
running requests preempt each other; then the pair one after the other (a prefix-cache hit). Each run:
  flashinfer + CUDA graphs, flashinfer eager, torch_native (bfloat16), judged against the float32
  reference with a divergence accepted only where its top-two gap is within twice the bfloat16 noise;
  torch_native float32, judged against the float32 reference with the CPU tests' 1e-3;
and after each: preemptions > 0, the prefix hit, every KV block free, no request left (tests/engines.py).
(3) The server: `python server.py` on the model, one streamed chat through the OpenAI SDK, then
scripts/bench_serving.py for --duration seconds at --request-rate and at inf (64 clients): TTFT, TPOT,
ITL, throughput, 0 failed; then /metrics: no request running, KV-cache usage 0.
Prints PASS/FAIL per check and exits 1 when one fails; results.json and the server's log go to --out.

Here, once (the tokenizer to carry):
    python scripts/gpu_e2e.py --write-tokenizer .gpu/tokenizer
A dry run on the CPU (2 layers, cpu/torch_native backends in place of flashinfer):
    python scripts/gpu_e2e.py --tokenizer .gpu/tokenizer --device cpu --layers 2 --duration 3
On the GPU (see docs/benchmarks.md "GPU" for the whole call, wheels included):
    python3 scripts/gpu_e2e.py --tokenizer .gpu/tokenizer --out $OUT
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from make_1b_model import SHAPE, write_hf  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS, BLOCKS, STEP_TOKENS = 32, 200, 512
RESULTS: dict = {"checks": {}}


def check(name: str, ok: bool, detail: str = "") -> bool:
    """Records and prints one check."""
    RESULTS["checks"][name] = {"ok": bool(ok), "detail": detail}
    print(f"[{'PASS' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def stage(name: str):
    """Runs a stage function, printing its time; an exception fails the stage and the run goes on."""

    def wrap(fn):
        def run(*args, **kwargs):
            print(f"--- {name}", flush=True)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            except Exception:
                traceback.print_exc()
                check(name, False, "raised (traceback above)")
            finally:
                print(f"--- {name}: {time.perf_counter() - start:.1f} s", flush=True)

        return run

    return wrap


def make_prompts(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """(14 prompts run together, the donor and the prompt sharing its first 256 tokens)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_common import DEFAULT_WORKLOAD, load_jsonl

    work = load_jsonl(DEFAULT_WORKLOAD)
    batch = [work[i].prompt_token_ids for i in range(0, 60, 5)]  # 12 prompts of 64 .. 470 tokens
    special = set(tokenizer.all_special_ids)
    vocab = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    gen = torch.Generator().manual_seed(0)

    def rand(n):
        return vocab[torch.randint(len(vocab), (n,), generator=gen)].tolist()

    batch += [rand(1500), rand(2000)]
    donor = rand(300)
    return batch, [donor, donor[:256] + rand(40)]


@torch.inference_mode()
def reference(model, prompts: list[list[int]], device: str) -> list[dict]:
    """transformers' greedy continuation of each prompt alone: tokens, top-two gaps, first-step logits."""
    refs = []
    for ids in prompts:
        out = model(torch.tensor([ids], device=device), use_cache=True)
        tokens, gaps, first = [], [], out.logits[0, -1].float()
        for _ in range(NEW_TOKENS):
            logits = out.logits[0, -1].float()
            top = logits.topk(2).values
            gaps.append(float(top[0] - top[1]))
            tokens.append(int(logits.argmax()))
            out = model(
                torch.tensor([[tokens[-1]]], device=device), past_key_values=out.past_key_values, use_cache=True
            )
        refs.append({"tokens": tokens, "gaps": gaps, "first": first.cpu()})
    return refs


def judge(ours: list[int], ref: dict, tol: float) -> tuple[bool, int, str]:
    """(agrees, tokens equal before the first divergence, why not): a divergence is accepted only at a
    step where the reference's top-two gap is below `tol` (tests/conftest.py's rule)."""
    for step, (a, b) in enumerate(zip(ours, ref["tokens"])):
        if a != b:
            gap = ref["gaps"][step]
            return gap < tol, step, f"step {step}: ours {a}, reference {b}, gap {gap:.3g}"
    return len(ours) == len(ref["tokens"]), len(ours), ""


@stage("references")
def make_references(model_dir: str, prompts: list[list[int]], device: str) -> dict:
    from transformers import AutoModelForCausalLM

    refs = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        refs[name] = reference(model, prompts, device)
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        took = time.perf_counter() - start
        print(f"  transformers {name}: {len(prompts)} prompts x {NEW_TOKENS} tokens in {took:.1f} s")
    noise = max(float((b["first"] - f["first"]).abs().max()) for b, f in zip(refs["bfloat16"], refs["float32"]))
    refs["bf16_tol"] = 2 * noise
    hf_ok = [judge(b["tokens"], f, refs["bf16_tol"])[0] for b, f in zip(refs["bfloat16"], refs["float32"])]
    print(f"  bfloat16 noise (max first-step logit difference) {noise:.3g}: tolerance {refs['bf16_tol']:.3g}")
    print(f"  transformers bfloat16 vs float32 under that rule: {sum(hf_ok)}/{len(hf_ok)} agree (calibration)")
    RESULTS["bf16_tolerance"] = refs["bf16_tol"]
    return refs


@stage("engine")
def run_engine(label: str, model_dir: str, kwargs: dict, prompts, pair, refs, tol: float, device: str) -> list:
    from engine import LLM, SamplingParams
    from tests.engines import assert_no_leak

    start = time.perf_counter()
    llm = LLM(
        model=model_dir,
        device=device,
        max_model_len=4096,
        max_num_seqs=16,
        max_num_batched_tokens=STEP_TOKENS,
        num_gpu_blocks_override=BLOCKS,
        **kwargs,
    )
    built = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    batched = time.perf_counter() - start
    core = llm.engine.engine_core
    preemptions = core.scheduler.num_preemptions
    donor = llm.generate([pair[0]], params, use_tqdm=False)[0]
    sharer = llm.generate([pair[1]], params, use_tqdm=False)[0]
    outs += [donor.outputs[0].token_ids, sharer.outputs[0].token_ids]
    verdicts = [judge(o, r, tol) for o, r in zip(outs, refs)]
    agree = sum(v[0] for v in verdicts)
    equal = sum(v[1] for v in verdicts)
    runner = core.executor.runner
    graphs = runner.graphs is not None
    print(
        f"  {label}: backend {type(runner.backend).__name__}, CUDA graphs {graphs}, dtype {runner.dtype}, "
        f"built in {built:.1f} s, {len(prompts)} prompts in {batched:.2f} s, {preemptions} preemptions, "
        f"prefix hit {sharer.num_cached_tokens} tokens"
    )
    for i, (ok, n, why) in enumerate(verdicts):
        if n < NEW_TOKENS:
            print(
                f"    prompt {i} ({len((prompts + pair)[i])} tokens): {n} equal, {'near tie' if ok else 'FAIL'}: {why}"
            )
    check(f"{label}: greedy vs transformers", agree == len(refs), f"{agree}/{len(refs)} agree, {equal} tokens equal")
    check(f"{label}: preemption forced", preemptions > 0, f"{preemptions}")
    check(f"{label}: prefix-cache hit", sharer.num_cached_tokens >= 256, f"{sharer.num_cached_tokens} tokens cached")
    try:
        assert_no_leak(llm.engine)
        check(f"{label}: every KV block free, no request left", True)
    except AssertionError as e:
        check(f"{label}: every KV block free, no request left", False, str(e))
    RESULTS[label] = dict(agree=agree, tokens_equal=equal, preemptions=preemptions, built_s=built, batched_s=batched)
    del llm, core, runner
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        print(f"  after: {torch.cuda.memory_allocated() / 2**20:.0f} MiB allocated on the GPU")
    return outs


@stage("server")
def run_server(model_dir: str, out: Path, duration: float, rate: float, device: str) -> None:
    import httpx
    from openai import OpenAI
    from prometheus_client.parser import text_string_to_metric_families

    from scripts.server_process import ServerProcess

    start = time.perf_counter()
    server = ServerProcess(["--model", model_dir, "--device", device, "--max-model-len", "4096"], timeout=600)
    print(f"  ready in {time.perf_counter() - start:.1f} s at {server.url}")
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        chunks = list(
            client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[{"role": "user", "content": "Name three colours."}],
                max_tokens=16,
                stream=True,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        check("server: streamed chat through the OpenAI SDK", len(chunks) > 2, f"{len(chunks)} chunks, {text!r}")
        results = out / "serving"
        cmd = [
            sys.executable,
            str(REPO / "scripts" / "bench_serving.py"),
            "--base-url",
            server.url,
            "--duration",
            str(duration),
            "--request-rate",
            str(rate),
            "inf",
            "--max-concurrency",
            "64",
            "--metric-percentiles",
            "50,99",
            "--label",
            f"ours-{device}",
            "--result-dir",
            str(results),
            "--disable-tqdm",
        ]
        print("  " + " ".join(cmd), flush=True)
        bench = subprocess.run(cmd, capture_output=True, text=True)
        print(bench.stdout[-6000:], bench.stderr[-2000:], flush=True)
        runs = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
        failed = sum(r["failed"] for r in runs)
        check("server: benchmark ran with 0 errors", bench.returncode == 0 and runs and not failed, f"{failed} failed")
        RESULTS["serving"] = [
            {k: v for k, v in r.items() if not isinstance(v, list)} for r in runs
        ]  # per-request lists stay in the JSONs
        metrics = {
            s.name: s.value
            for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
            for s in fam.samples
        }
        running, usage = metrics.get("vllm:num_requests_running"), metrics.get("vllm:kv_cache_usage_perc")
        check(
            "server: after the benchmark no request runs and the KV cache is free",
            running == 0 and usage == 0,
            f"running {running}, kv_cache_usage_perc {usage}",
        )
        if device == "cuda":
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            )
            print(f"  GPU memory with the server up (its KV cache allocated once): {smi.stdout.strip()}")
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=60)
        (out / "server.log").write_text(server.log()[-200_000:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-tokenizer", type=Path, metavar="DIR", help="save the default model's tokenizer; exit")
    ap.add_argument("--tokenizer", type=Path, default=REPO / ".gpu" / "tokenizer")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the script")
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/gpu-e2e/llama-1b-random"))
    ap.add_argument("--out", type=Path, default=Path("results/gpu-e2e"))
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of each serving benchmark run")
    ap.add_argument("--request-rate", type=float, default=16.0, help="the finite rate of the serving benchmark")
    ap.add_argument("--skip", nargs="*", default=[], choices=["engine", "server"])
    args = ap.parse_args()
    if args.write_tokenizer:
        from models.loader import default_model_path, load_tokenizer

        load_tokenizer(default_model_path()).save_pretrained(args.write_tokenizer)
        return print(f"wrote {args.write_tokenizer}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --device cpu for a dry run)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    model_dir = str(args.model_dir)
    if not (args.model_dir / "model.safetensors").exists():
        start = time.perf_counter()
        write_hf(args.model_dir, dict(SHAPE, layers=args.layers), seed=0, tokenizer=str(args.tokenizer))
        print(f"model written in {time.perf_counter() - start:.1f} s: {model_dir}")
    from transformers import AutoTokenizer

    batch, pair = make_prompts(AutoTokenizer.from_pretrained(model_dir))
    prompts = batch + pair
    if "engine" not in args.skip:
        refs = make_references(model_dir, prompts, args.device)
        if refs is not None:
            fast = "flashinfer" if args.device == "cuda" else "cpu"
            runs = [
                (f"{fast} + CUDA graphs", dict(dtype="bfloat16", attention_backend=fast), "bfloat16"),
                (f"{fast}, eager", dict(dtype="bfloat16", attention_backend=fast, enforce_eager=True), "bfloat16"),
                ("torch_native bfloat16", dict(dtype="bfloat16", attention_backend="torch_native"), "bfloat16"),
                ("torch_native float32", dict(dtype="float32", attention_backend="torch_native"), "float32"),
            ]
            tokens = {}
            for label, kwargs, dtype in runs:
                tol = refs["bf16_tol"] if dtype == "bfloat16" else 1e-3
                tokens[label] = run_engine(label, model_dir, kwargs, batch, pair, refs["float32"], tol, args.device)
            first = tokens[runs[0][0]]
            for label, _, _ in runs[1:]:
                if first and tokens[label]:
                    same = sum(a == b for a, b in zip(first, tokens[label]))
                    print(f"  {runs[0][0]} and {label}: {same}/{len(first)} prompts with identical tokens")
    if "server" not in args.skip:
        run_server(model_dir, args.out, args.duration, args.request_rate, args.device)
    ok = all(c["ok"] for c in RESULTS["checks"].values())
    (args.out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    print(
        "ALL CHECKS PASS"
        if ok
        else "SOME CHECK FAILED: " + ", ".join(k for k, c in RESULTS["checks"].items() if not c["ok"])
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
