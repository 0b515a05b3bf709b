"""Our engine side by side with its peers on one workload, in one process run: Hugging Face
transformers' static `generate` (length-sorted batches of --hf-batch-size, left padding) and its
continuous batching (`generate_batch`: paged KV cache, a scheduler thread), with --with-vllm vLLM's CPU
build through ../shared/peers/vllm_cpu.sh in a subprocess, and with --llama-server llama.cpp's server
on the GGUF with --llama-slots slots (continuous batching; every request sent at once, one client
thread per slot; each slot's context is the longest request rounded up to 256 tokens, its per-step
token limit -b is our --max-num-batched-tokens; started once per run and stopped at the end). --vllm-awq DIR adds
vLLM-CPU's int4 path on an AWQ checkpoint of the same shape (scripts/make_awq_model.py; W4A16, and W4A8 on an AMX
CPU), --with-openvino OpenVINO GenAI on the GGUF (../shared/peers/openvino_peer.sh), in this mode and the two below.

Every engine gets the same weights (a GGUF model: ours and llama.cpp read the file; transformers and
vLLM, which cannot read GGUF on the CPU, get it dequantized to a Hugging Face directory, or
--vllm-model), dtype, prompt token ids and number of output tokens (greedy, EOS ignored: every request
produces exactly its max_tokens); transformers and llama.cpp run with the same threads as our engine
(torch's) and transformers' continuous batching with the same KV-cache bytes and per-step token and
request limits; no engine reuses a previous round's KV blocks (ours starts each round with an empty
prefix cache, llama-server gets cache_prompt false and no host-memory prompt cache). The engines
alternate within each of --repeats rounds, because this machine's speed drifts; the table reports each
engine's median output tokens/s (output tokens / wall seconds of its generate call, or of the round of
requests for llama-server) and the ratio ours / engine. "same first 16" is the share of requests whose
first 16 output tokens equal ours: a check that every engine ran the same model on the same tokens
(bfloat16 rounding, or llama.cpp's own quantized arithmetic, can legitimately flip a few).

The GGUF llama.cpp runs: --model when it is a .gguf, else --gguf (without --model: the default model's file).

With --latency it measures batch-1 decode instead: each of --latency-prompts prompts of the workload
(truncated to 434 tokens, or --latency-depth) runs alone for --output-len tokens (greedy, EOS ignored, prefix cache
reset before each run). Ours: its TPOT, (last token time - first token time) / (N - 1) from the request's own
metrics, so the prefill stays out as it does from llama-bench's decode timing (a 434-token prefill of an MoE
model varies by a second between runs on these VMs, which (t(N) - t(1)) / (N - 1) carried into every figure);
the other engines run for 1 and for N tokens, ms per output token = (t(N) - t(1)) / (N - 1), so prefill and
per-request overheads cancel. The table gives each engine's median over prompts and rounds. Peers: vLLM-CPU
(--with-vllm, scripts/vllm_latency.py in its venv), llama.cpp's llama-bench (--llama-bench: `-p 0 -n N
-d 434 -r 1`, decode of N tokens at a context depth of 434; ms per token = 1000 / its avg_ts) and
llama-server (--llama-server, one slot, the same two runs as ours) on the GGUF, all with our thread
count (llama.cpp's killed by a signal, as its AMX path on the pool's AMX Xeon, runs again with --repack 0);
--ik-llama-bench adds ik_llama.cpp's llama-bench (`-gp 434,N`) with run-time repacking off and on (-rtr 0, 1).
scripts/build_llama_server.sh builds llama.cpp and prints its bin directory; scripts/build_ik_llama.sh
ik_llama.cpp's llama-bench from a source tree.

With --prompt N it measures prompt processing (llama-bench's ppN): an N-token prompt alone (max_tokens 1,
prefix cache reset), N / its seconds, against `llama-bench -p N -n 0` of each llama-bench given.

Usage:
  python scripts/bench_peers.py --num-requests 16 --repeats 3         # a few minutes
  B=$(scripts/build_llama_server.sh)  # builds llama.cpp once (~15 min), prints ~/.cache/minivllm/llama.cpp/build/bin
  python scripts/bench_peers.py --repeats 3 --skip static continuous --llama-server $B/llama-server --with-vllm  # W64
  python scripts/bench_peers.py --latency --repeats 3 --llama-bench $B/llama-bench --with-vllm
  IK=$(scripts/build_ik_llama.sh ~/src/ik_llama.cpp)  # ik_llama.cpp's llama-bench, once
  python scripts/bench_peers.py --prompt 512 --repeats 2 --llama-bench $B/llama-bench --ik-llama-bench $IK/llama-bench
"""

import argparse
import contextlib
import json
import logging
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from gguf import LlamaFileType
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench_common import DEFAULT_WORKLOAD, REPO, Request, load_jsonl, random_requests, run_info  # noqa: E402

from api.cli import byte_size  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.worker.host_memory import wait_for_prefault  # noqa: E402
from engine.worker.model_runner import cpu_flags  # noqa: E402
from models.gguf import is_gguf, read_header  # noqa: E402
from models.loader import default_model_path, export_hf_directory  # noqa: E402

VLLM_SCRIPT = REPO.parent / "shared" / "peers" / "vllm_cpu.sh"
OPENVINO_SCRIPT = REPO.parent / "shared" / "peers" / "openvino_peer.sh"
MATCH_PREFIX = 16  # output tokens compared with ours
LATENCY_PROMPT_LEN = 434  # tokens of each batch-1 latency prompt


def run_ours(llm: LLM, reqs: list[Request]) -> list[list[int]]:
    llm.reset_prefix_cache()  # the rounds repeat the prompts; each round starts cold
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    outs = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run_hf_static(model, tokenizer, reqs: list[Request], batch_size: int) -> list[list[int]]:
    """`generate` on batches of similar prompt lengths (sorting spares it most of the padding, which a
    user batching offline would do too); min_new_tokens = max_new_tokens makes it ignore EOS."""
    n = reqs[0].max_tokens
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=model.generation_config.eos_token_id,
    )
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].prompt_token_ids))
    outputs: list[list[int]] = [[] for _ in reqs]
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        inputs = tokenizer.pad(
            {"input_ids": [reqs[i].prompt_token_ids for i in batch]}, padding_side="left", return_tensors="pt"
        )
        generated = model.generate(**inputs, generation_config=config)[:, inputs["input_ids"].shape[1] :]
        for i, row in zip(batch, generated.tolist()):
            outputs[i] = row
    return outputs


def run_hf_continuous(model, reqs: list[Request], cb_config: ContinuousBatchingConfig) -> list[list[int]]:
    """`generate_batch`; eos_token_id=-1 turns EOS off (its scheduler has no min_new_tokens). The manager is
    kept between calls, so its KV-cache allocation is paid once, like our engine's."""
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=reqs[0].max_tokens,
        eos_token_id=-1,
        pad_token_id=model.generation_config.pad_token_id,
    )
    results = model.generate_batch(
        [r.prompt_token_ids for r in reqs],
        generation_config=config,
        continuous_batching_config=cb_config,
        persistent_manager=True,
    )
    return [list(r.generated_tokens) for r in results.values()]  # in input order


def run_json(cmd: list[str], name: str, env: dict | None = None) -> dict:
    """Runs a peer's runner `cmd` (with `env` added to the environment) and returns the last JSON line it printed.
    Raises RuntimeError, naming `name`, where it failed or printed none."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def run_vllm(script: Path, model_dir: str, dtype: str, reqs: list[Request], env: dict | None = None) -> float:
    """One vLLM-CPU process on `reqs` (it warms up on 4 of them, then times one `generate` call), with `env` added
    to its environment; returns its output tokens/s."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
        for r in reqs:
            f.write(json.dumps({"prompt_token_ids": r.prompt_token_ids}) + "\n")
        f.flush()
        result = run_json(
            [str(script), "--model", model_dir, "--dtype", dtype, "--repeats", "1", "--workload", f.name],
            str(script),
            env,
        )
    if result["requests"] != len(reqs):
        raise RuntimeError(f"vLLM ran {result['requests']} requests, expected {len(reqs)}")
    return result["output_tok_s_median"]


def awq_variants() -> dict[str, dict]:
    """vLLM-CPU's int4 paths for an AWQ checkpoint on this CPU (name -> environment): W4A16 everywhere, and W4A8
    (VLLM_CPU_INT4_W4A8=1) where the CPU has AMX tiles, the only place vLLM takes it."""
    variants = {"W4A16": {"VLLM_CPU_INT4_W4A8": "0"}}
    if "amx_int8" in cpu_flags():
        variants["W4A8"] = {"VLLM_CPU_INT4_W4A8": "1"}
    return variants


def run_openvino(script: Path, gguf: str, reqs: list[Request]) -> dict:
    """OpenVINO GenAI on the GGUF file through `script` (../shared/peers/openvino_peer.sh, which installs it in its
    own venv once): `reqs` as text (its tokenizer is the GGUF's, so the same tokens) x 128 output tokens, then its
    batch-1 ms/token after the 11th request and pp512; returns its JSON line (output_tok_s, b1_ms, pp512_tok_s).
    Raises SystemExit for requests without their text."""
    if any(r.prompt is None for r in reqs) or len(reqs) < 11:
        raise SystemExit("OpenVINO's runner takes prompts as text: a workload with `prompt` fields, 11 or more")
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
        f.writelines(json.dumps({"prompt": r.prompt}) + "\n" for r in reqs)
        f.flush()
        return run_json(["bash", str(script), gguf, "--requests", str(len(reqs)), "--workload", f.name], str(script))


def ms_per_token(run, prompt: list[int], n: int) -> float:
    """Batch-1 decode latency from two runs of `run(prompt, max_tokens) -> seconds`: (t(n) - t(1)) / (n - 1)."""
    return 1e3 * (run(prompt, n) - run(prompt, 1)) / (n - 1)


def ours_latency(llm: LLM, prompts: list[list[int]], n: int) -> list[float]:
    """Our batch-1 TPOT of each prompt, in ms: (last token time - first token time) / (n - 1), the request's own
    metrics (n >= 2 tokens, greedy, EOS ignored, prefix cache reset first)."""
    tpot = []
    for prompt in prompts:
        llm.reset_prefix_cache()
        [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        m = out.metrics
        tpot.append(1e3 * (m.last_token_time - m.first_token_time) / (m.num_generation_tokens - 1))
    return tpot


def vllm_latency(
    script: Path, model_dir: str, dtype: str, prompts: list[list[int]], n: int, env: dict | None = None
) -> list[float]:
    """scripts/vllm_latency.py in the venv that `script` (vllm_cpu.sh) installs, with `env` added to its
    environment; ms per token per prompt."""
    venv = Path(os.environ.get("VLLM_VENV", "/tmp/venv-vllm-cpu"))
    if not (venv / "bin" / "python").exists():
        subprocess.run([str(script), "--help"], check=True, capture_output=True)  # installs vLLM-CPU once
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
        f.writelines(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts)
        f.flush()
        cmd = [str(venv / "bin" / "python"), str(REPO / "scripts" / "vllm_latency.py"), "--model", model_dir]
        cmd += ["--dtype", dtype, "--prompts", f.name, "--max-tokens", str(n)]
        return run_json(cmd, "vllm_latency.py", env)["ms_per_token"]


def llama_bench(
    binary: str, gguf: str, *, gen: int = 0, depth: int = 0, prompt: int = 0, ik: bool = False, extra: tuple = ()
) -> list[float]:
    """One llama-bench test on `gguf` with our threads, as [ms per token]: decode of `gen` tokens at a context
    depth of `depth` (the depth is filled before the timed decode, so it adds no prefill to the time), or the
    prefill of a `prompt`-token prompt. llama.cpp spells the decode test `-p 0 -n GEN -d DEPTH`; ik_llama.cpp
    (`ik`), whose llama-bench has no -d, `-p 0 -n 0 -gp DEPTH,GEN`. `extra`: more flags (ik's `-rtr 1`)."""
    if prompt:
        test = ["-p", str(prompt), "-n", "0"]
    elif ik:
        test = ["-p", "0", "-n", "0", "-gp", f"{depth},{gen}"]
    else:
        test = ["-p", "0", "-n", str(gen), "-d", str(depth)]
    cmd = [binary, "-m", gguf, *test, "-t", str(torch.get_num_threads()), "-r", "1", "-o", "json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode < 0 and not ik and "--repack" not in extra:
        # llama.cpp 11434's AMX path faults (SIGILL, SIGSEGV) on the pool's AMX Xeon: it runs there unrepacked
        print(f"llama-bench died of signal {-proc.returncode}; again with --repack 0", flush=True)
        return llama_bench(binary, gguf, gen=gen, depth=depth, prompt=prompt, extra=(*extra, "--repack", "0"))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [1e3 / json.loads(proc.stdout)[0]["avg_ts"]]


def llama_bench_engines(args, gguf: str, **test) -> dict:
    """The llama-bench peers the flags name, each `() -> [ms per token]` for `llama_bench(**test)`:
    llama.cpp's (--llama-bench) and ik_llama.cpp's (--ik-llama-bench) with run-time repacking off and on
    (`-rtr 0`, `-rtr 1`: its R4/R8 interleaved layouts; the issue takes the better of the two)."""
    label = f"GGUF {gguf_type(gguf)}"
    engines = {}
    if args.llama_bench:
        engines[f"llama.cpp llama-bench ({label})"] = lambda: llama_bench(args.llama_bench, gguf, **test)
    if args.ik_llama_bench:
        for rtr in (0, 1):
            engines[f"ik_llama.cpp -rtr {rtr} ({label})"] = lambda rtr=rtr: llama_bench(
                args.ik_llama_bench, gguf, ik=True, extra=("-rtr", str(rtr)), **test
            )
    return engines


def free_port() -> int:
    """A TCP port nobody listens on now: a fixed one could answer /health from another engineer's server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama.cpp's llama-server on a GGUF (127.0.0.1, our threads): `slots` sequences at once, each with a
    context of `ctx` tokens, at most `batch` tokens per step (continuous batching is on by default). A
    context manager: leaving it stops the server."""

    def __init__(self, binary: str, gguf: str, slots: int = 1, ctx: int = 4096, batch: int = 2048):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.slots = slots
        self.log = tempfile.TemporaryFile()  # its output, shown if it fails to start
        # -ub 512 is its default micro-batch; --cache-ram 0 turns off its host-memory prompt cache, which
        # would copy every finished slot's KV for a reuse that cache_prompt false forbids anyway.
        self.proc = subprocess.Popen(
            [
                binary,
                "-m",
                gguf,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-np",
                str(slots),
                "-c",
                str(slots * ctx),
                "-b",
                str(batch),
                "-ub",
                "512",
                "--cache-ram",
                "0",
                "--no-webui",
                "-t",
                str(torch.get_num_threads()),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                tail = self.log.read()[-3000:].decode(errors="replace")
                self.close()
                raise RuntimeError(f"llama-server did not start (exit {self.proc.returncode}):\n{tail}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        """Whether /health answers 200 (it answers 503 while the model loads)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def complete(self, prompt: list[int], k: int) -> list[int]:
        """Greedy completion of `k` tokens (temperature 0 keeps only the top logit; EOS ignored); returns
        the token ids. cache_prompt false makes it compute the whole prompt even when a slot still holds
        its KV from an earlier round, so no cache needs erasing between rounds."""
        body = json.dumps(
            {
                "prompt": prompt,
                "n_predict": k,
                "temperature": 0,
                "cache_prompt": False,
                "ignore_eos": True,
                "return_tokens": True,
            }
        ).encode()
        request = urllib.request.Request(f"{self.url}/completion", body, {"Content-Type": "application/json"})
        # the answer comes whole at the end, after every request ahead of it in a big round
        with urllib.request.urlopen(request, timeout=3600) as r:
            return json.loads(r.read())["tokens"]

    def run(self, prompt: list[int], k: int) -> float:
        """Seconds of one completion (the `run` of ms_per_token)."""
        start = time.perf_counter()
        self.complete(prompt, k)
        return time.perf_counter() - start

    def run_all(self, reqs: list[Request]) -> list[list[int]]:
        """Every request sent at once, one client thread per slot (more would only queue in the server);
        returns the token ids in request order."""
        with ThreadPoolExecutor(self.slots) as pool:
            return list(pool.map(lambda r: self.complete(r.prompt_token_ids, r.max_tokens), reqs))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def gguf_of(args) -> str:
    """The GGUF llama.cpp runs: --model when it is one, else --gguf, else (no --model) the default model's.
    Read from the arguments, not from our engine, whose model_dir need not be the file."""
    if args.model and is_gguf(args.model):
        return str(Path(args.model).expanduser())
    if args.gguf:
        return str(Path(args.gguf).expanduser())
    if args.model is None:
        return default_model_path()
    raise SystemExit("llama.cpp reads GGUF: give --gguf for a Hugging Face model")


def gguf_type(path: str) -> str:
    """The file's weight type, e.g. Q4_1 or Q4_K_M: its general.file_type, else the end of its name."""
    try:
        return LlamaFileType(read_header(path)[1]["general.file_type"]).name.removeprefix("MOSTLY_")
    except (KeyError, ValueError):  # no file_type, a number gguf-py does not know, or a header we cannot read
        match = re.search(r"[.-]((?:I?Q\d|BF16|F16|F32)\w*)$", Path(path).stem, re.IGNORECASE)
        return match.group(1).upper() if match else Path(path).name


def latency_main(args, llm: LLM, reqs: list[Request]) -> None:
    """The --latency mode: batch-1 ms per output token of every engine, alternating over rounds."""
    depth = args.latency_depth
    if depth <= LATENCY_PROMPT_LEN:
        long = [r.prompt_token_ids[:depth] for r in reqs if len(r.prompt_token_ids) >= depth]
    else:  # deeper than any prompt: the workload's prompts end to end, from a different one each time
        ids = [t for r in reqs for t in r.prompt_token_ids]
        long = [(ids[i * 997 :] + ids)[:depth] for i in range(args.latency_prompts)]
    prompts = long[: args.latency_prompts]
    n = args.output_len or 64
    engines = {"ours": lambda: ours_latency(llm, prompts, n)}
    if args.with_vllm:
        vllm_model = args.vllm_model or export_hf_directory(llm.model_dir)
        engines["vllm-cpu (subprocess, bf16 directory)"] = lambda: vllm_latency(
            args.vllm_script, vllm_model, args.dtype, prompts, n
        )
    for variant, env in awq_variants().items() if args.vllm_awq else ():
        engines[f"vllm-cpu AWQ {variant} (subprocess)"] = lambda env=env: vllm_latency(
            args.vllm_script, args.vllm_awq, args.dtype, prompts, n, env
        )
    if args.with_openvino:  # its own batch-1 prompt: the workload's request 10 (434 tokens on the default model)
        if depth != LATENCY_PROMPT_LEN:
            raise SystemExit(f"--with-openvino: OpenVINO's batch 1 runs at its own {LATENCY_PROMPT_LEN}-token prompt")
        engines["openvino-genai (subprocess, GGUF)"] = lambda: [
            run_openvino(args.openvino_script, gguf_of(args), reqs[:16])["b1_ms"]
        ]
    with contextlib.ExitStack() as stack:  # stops llama-server at the end, on errors too
        if args.llama_bench or args.ik_llama_bench or args.llama_server:
            gguf = gguf_of(args)
            label = f"GGUF {gguf_type(gguf)}"
        if args.llama_bench or args.ik_llama_bench:
            engines.update(llama_bench_engines(args, gguf, gen=n, depth=depth))
        if args.llama_server:
            server = stack.enter_context(LlamaServer(args.llama_server, gguf))
            server.complete(prompts[0], 4)  # warm-up
            engines[f"llama.cpp llama-server ({label})"] = lambda: [ms_per_token(server.run, p, n) for p in prompts]
        ours_latency(llm, prompts[:1], 4)  # warm-up
        print(
            f"batch 1: {len(prompts)} prompts of {depth} tokens, {n} output tokens, {args.dtype}, "
            f"{torch.get_num_threads()} threads"
        )
        medians = alternate(engines, args.repeats, "ms/token")
    report(args, "latency", medians, "ms per output token", "it / ours", "ms_per_token_median", lambda m: m)


def alternate(engines: dict, repeats: int, unit: str) -> dict[str, tuple[float, list[float]]]:
    """Runs every engine (`() -> [values]`) once per round, alternating, for `repeats` rounds (this machine's
    speed drifts), once the KV cache's prefault is done; returns each engine's (median, all values)."""
    wait_for_prefault()
    results: dict[str, list[float]] = {}
    for rnd in range(repeats):
        for name, fn in engines.items():
            values = fn()
            results.setdefault(name, []).extend(values)
            print(f"round {rnd + 1}/{repeats}  {name:<40} {statistics.median(values):9.2f} {unit}", flush=True)
    return {name: (statistics.median(v), v) for name, v in results.items()}


def report(args, mode: str, medians: dict, column: str, ratio: str, key: str, value) -> None:
    """Prints each engine's `value(median ms per token)` and its ratio to ours (median ms / ours'), and writes
    them to --output-json under `key`."""
    print(f"\n{'engine':<40} {column:>20} {ratio:>10}")
    for name, (m, _) in medians.items():
        print(f"{name:<40} {value(m):20.2f} {m / medians['ours'][0]:9.2f}x")
    write_json(args, mode, {name: {key: value(m), "ms_per_token_runs": runs} for name, (m, runs) in medians.items()})


def write_json(args, mode: str, engines: dict) -> None:
    """--output-json: the run's configuration and every engine's measurements."""
    if args.output_json:
        record = {**run_info(), "mode": mode, "args": {k: str(v) for k, v in vars(args).items()}, "engines": engines}
        Path(args.output_json).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.output_json}")


def prompt_main(args, llm: LLM, reqs: list[Request]) -> None:
    """The --prompt N mode (llama-bench's ppN): prefill tokens per second of one N-token prompt run alone, the
    prefix cache reset before each run. Ours: N / the seconds of `generate(prompt, max_tokens=1)` (the
    prefill's last position gives the one token, as llama-bench's prompt test computes the last logits);
    llama.cpp and ik_llama.cpp: llama-bench `-p N -n 0`. Prompts: the workload's, end to end."""
    n = args.prompt
    ids = [t for r in reqs for t in r.prompt_token_ids]
    prompts = [(ids[i * 997 :] + ids)[:n] for i in range(args.latency_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ours() -> list[float]:
        out = []
        for p in prompts:
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate([p], params, use_tqdm=False)
            out.append(1e3 * (time.perf_counter() - start) / n)
        return out

    engines = {"ours": ours}
    if args.llama_bench or args.ik_llama_bench:
        engines.update(llama_bench_engines(args, gguf_of(args), prompt=n))
    if args.with_openvino:
        if n != 512:
            raise SystemExit("--with-openvino measures OpenVINO's prompts at 512 tokens only (--prompt 512)")
        engines["openvino-genai (subprocess, GGUF)"] = lambda: [
            1e3 / run_openvino(args.openvino_script, gguf_of(args), reqs[:16])["pp512_tok_s"]
        ]
    ours()  # warm-up
    print(f"prompt processing: {len(prompts)} prompts of {n} tokens, {args.dtype}, {torch.get_num_threads()} threads")
    medians = alternate(engines, args.repeats, "ms/token")
    report(args, "prompt", medians, "prompt tok/s", "ours / it", "tok_s_median", lambda m: 1e3 / m)


def slot_context(reqs: list[Request]) -> int:
    """llama-server's context per slot: the longest request (prompt and output), rounded up to 256 tokens."""
    return -(-max(len(r.prompt_token_ids) + r.max_tokens for r in reqs) // 256) * 256


def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    """Bytes of K and V over all layers for one token."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * dtype.itemsize


def timed(fn, reqs: list[Request]) -> tuple[float, list[list[int]]]:
    """Runs fn(reqs); returns output tokens/s and the outputs. Raises if any request did not get exactly
    its max_tokens: a peer that stopped early (or ran long) would not be comparable."""
    start = time.perf_counter()
    outputs = fn(reqs)
    seconds = time.perf_counter() - start
    lengths = [len(o) for o in outputs]
    if lengths != [r.max_tokens for r in reqs]:
        raise RuntimeError(f"output lengths {lengths} differ from max_tokens {[r.max_tokens for r in reqs]}")
    return sum(lengths) / seconds, outputs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default=str(DEFAULT_WORKLOAD), help="JSONL workload")
    ap.add_argument("--num-requests", type=int, help="first N requests (default: all)")
    ap.add_argument("--output-len", type=int, help="override every request's max_tokens")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; each engine runs once per round")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--model", help="as in bench_throughput.py (default: SmolLM2-135M-Instruct)")
    ap.add_argument(
        "--kv-cache-memory",
        type=byte_size,
        default=2 << 30,
        help="KV-cache size, e.g. 256M or 2G (ours and transformers CB)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=128, help="requests per step (ours and transformers CB)")
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens per step (ours and transformers CB)"
    )
    ap.add_argument("--hf-batch-size", type=int, default=8, help="batch size of transformers' static generate")
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["static", "continuous"],
        help="leave out transformers' static generate or its continuous batching (slow on CPU)",
    )
    ap.add_argument("--with-vllm", action="store_true", help=f"also run {VLLM_SCRIPT} (installs vLLM-CPU once)")
    ap.add_argument("--vllm-script", type=Path, default=VLLM_SCRIPT)
    ap.add_argument(
        "--vllm-awq",
        help="also run vLLM-CPU on this AWQ directory of the same shape (scripts/make_awq_model.py): W4A16, and W4A8 "
        "on a CPU with AMX",
    )
    ap.add_argument(
        "--with-openvino",
        action="store_true",
        help=f"also run OpenVINO GenAI on the GGUF file ({OPENVINO_SCRIPT}, which installs it once)",
    )
    ap.add_argument("--openvino-script", type=Path, default=OPENVINO_SCRIPT)
    ap.add_argument("--output-json", help="write the config and every measurement here")
    ap.add_argument("--latency", action="store_true", help="batch-1 decode ms per output token instead of throughput")
    ap.add_argument("--latency-prompts", type=int, default=3, help="--latency: prompts (each run alone)")
    ap.add_argument(
        "--latency-depth",
        type=int,
        default=LATENCY_PROMPT_LEN,
        help="--latency: tokens of each prompt (llama-bench's -d); past the longest prompt, prompts end to end",
    )
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary, run on the model's GGUF")
    ap.add_argument("--llama-slots", type=int, default=64, help="llama-server's slots in throughput mode")
    ap.add_argument("--llama-bench", help="--latency/--prompt: llama.cpp's llama-bench binary, on the model's GGUF")
    ap.add_argument(
        "--ik-llama-bench",
        help="--latency/--prompt: ik_llama.cpp's llama-bench (scripts/build_ik_llama.sh), -rtr 0 and 1",
    )
    ap.add_argument("--prompt", type=int, metavar="N", help="prompt processing of N-token prompts (llama-bench's ppN)")
    ap.add_argument(
        "--gguf", help="the GGUF llama.cpp runs when --model is not one (default without --model: the default model's)"
    )
    ap.add_argument(
        "--vllm-model",
        help="the bfloat16 Hugging Face directory of the same weights for vLLM (and "
        "transformers) (default: ours, a GGUF dequantized)",
    )
    ap.add_argument("--quantization", choices=["gguf", "none"], help="ours, as the server's flag")
    ap.add_argument("--kv-cache-dtype", default="auto", help="ours, as the server's flag (int8, fp8, ...)")
    args = ap.parse_args()
    if args.latency or args.prompt:
        dtype_kwargs = dict(
            dtype=args.dtype,
            kv_cache_memory=args.kv_cache_memory,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        main_of_mode = prompt_main if args.prompt else latency_main
        main_of_mode(args, LLM(model=args.model, **dtype_kwargs), load_jsonl(args.dataset))
        return

    reqs = load_jsonl(args.dataset, args.num_requests, args.output_len)
    if len({r.max_tokens for r in reqs}) != 1:
        ap.error(
            "transformers' generate_batch takes one max_new_tokens: give every request the same "
            "max_tokens (or --output-len)"
        )
    if (args.with_vllm or args.vllm_awq or args.with_openvino) and reqs[0].max_tokens != 128:
        ap.error("vLLM's and OpenVINO's runners always generate 128 tokens; use a 128-token workload with them")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # its per-call warnings are noise here

    dtype = getattr(torch, args.dtype)
    # Every round repeats the same prompts: ours keeps its default prefix caching (hashing cost
    # included) but empties the cache before each round; transformers' continuous batching, which
    # cannot, runs without block sharing.
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    # transformers and vLLM cannot read GGUF on the CPU: they get the same weights as a directory
    hf_dir = lambda: args.vllm_model or export_hf_directory(llm.model_dir)  # noqa: E731
    engines = {"ours": lambda rs: timed(lambda r: run_ours(llm, r), rs)}  # name -> fn(reqs) -> (tok/s, outputs)
    if {"static", "continuous"} - set(args.skip):
        model = AutoModelForCausalLM.from_pretrained(hf_dir(), dtype=dtype).eval()
        page_size = ContinuousBatchingConfig.page_size  # transformers' default page (block) size, in tokens
        cb_config = ContinuousBatchingConfig(
            num_blocks=args.kv_cache_memory // (page_size * kv_bytes_per_token(model.config, dtype)),
            max_batch_tokens=args.max_num_batched_tokens,
            max_requests_per_batch=args.max_num_seqs,
            allow_block_sharing=False,
        )
        if "static" not in args.skip:
            engines[f"transformers generate (static, batch {args.hf_batch_size})"] = lambda rs: timed(
                lambda r: run_hf_static(model, llm.tokenizer, r, args.hf_batch_size), rs
            )
        if "continuous" not in args.skip:
            engines["transformers generate_batch (continuous)"] = lambda rs: timed(
                lambda r: run_hf_continuous(model, r, cb_config), rs
            )
    # Warm-up on two short prompts outside the workload: first-call costs (allocations, the CB manager)
    # are not throughput. vLLM warms itself up.
    wait_for_prefault()
    warm = random_requests(2, 32, 4, llm.tokenizer, seed=1)
    for fn in engines.values():
        fn(warm)
    if args.with_vllm:
        vllm_model = hf_dir()
        engines["vllm-cpu (subprocess)"] = lambda rs: (run_vllm(args.vllm_script, vllm_model, args.dtype, rs), None)
    for variant, env in awq_variants().items() if args.vllm_awq else ():
        engines[f"vllm-cpu AWQ {variant} (subprocess)"] = lambda rs, env=env: (
            run_vllm(args.vllm_script, args.vllm_awq, args.dtype, rs, env),
            None,
        )
    if args.with_openvino:
        engines["openvino-genai (subprocess, GGUF)"] = lambda rs: (
            run_openvino(args.openvino_script, gguf_of(args), rs)["output_tok_s"],
            None,
        )
    rates: dict[str, list[float]] = {}
    outputs: dict[str, list[list[int]]] = {}
    with contextlib.ExitStack() as stack:  # stops llama-server at the end, on errors too
        if args.llama_server:
            gguf = gguf_of(args)
            server = stack.enter_context(
                LlamaServer(
                    args.llama_server,
                    gguf,
                    slots=args.llama_slots,
                    ctx=slot_context(reqs),
                    batch=args.max_num_batched_tokens,
                )
            )
            server.run_all(warm)
            engines[f"llama.cpp llama-server (GGUF {gguf_type(gguf)}, {args.llama_slots} slots)"] = lambda rs: timed(
                server.run_all, rs
            )
        print(
            f"{len(reqs)} requests, {sum(len(r.prompt_token_ids) for r in reqs)} prompt tokens, "
            f"{reqs[0].max_tokens} output tokens each, {args.dtype}, {torch.get_num_threads()} threads"
        )
        for rnd in range(args.repeats):
            for name, fn in engines.items():
                rate, outs = fn(reqs)
                rates.setdefault(name, []).append(rate)
                if outs is not None:
                    outputs.setdefault(name, outs)
                print(f"round {rnd + 1}/{args.repeats}  {name:<48} {rate:8.1f} output tok/s", flush=True)

    medians = {name: statistics.median(r) for name, r in rates.items()}
    ours = outputs["ours"]

    def same_prefix(name):
        if name not in outputs:
            return None
        return sum(a[:MATCH_PREFIX] == b[:MATCH_PREFIX] for a, b in zip(outputs[name], ours)) / len(ours)

    print(f"\n{'engine':<48} {'output tok/s':>12} {'ours / it':>10} {'same first 16':>14}   all runs")
    for name, median in medians.items():
        match = same_prefix(name)
        print(
            f"{name:<48} {median:12.1f} {medians['ours'] / median:9.2f}x "
            f"{'-' if match is None else f'{100 * match:.0f}%':>14}   {' '.join(f'{r:.1f}' for r in rates[name])}"
        )
    if args.output_json:
        record = {
            **run_info(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "model_dir": llm.model_dir,
            "num_requests": len(reqs),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
            "output_tokens_per_request": reqs[0].max_tokens,
            "engines": {
                name: {
                    "output_tok_s_median": medians[name],
                    "output_tok_s_runs": rates[name],
                    "ours_over_it": medians["ours"] / medians[name],
                    "same_first_16": same_prefix(name),
                }
                for name in engines
            },
        }
        Path(args.output_json).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
