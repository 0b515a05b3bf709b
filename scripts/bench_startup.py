"""Start-up time of `python server.py`: seconds from spawning the process to the first /health 200, the
median of a few starts, with where the time goes.

    python scripts/bench_startup.py                       # 3 warm starts of the default model
    python scripts/bench_startup.py --runs 5 -- --kv-cache-memory 2G --dtype bfloat16
    python scripts/bench_startup.py --breakdown           # also an in-process profile of each phase

Phases of a start, from the server's log: "python + imports" (interpreter start, torch, transformers and
the server's modules, flags), the engine's own line "engine built in ...: model config, tokenizer, model
and KV cache", "app + uvicorn" (to the "ready" line) and "first /health". `--breakdown` times the engine's
steps one by one in this process (imports, model config, tokenizer, attention backend including the C
kernel's build check, model build, weights, KV-cache allocation); run it after a server start so the
compiled kernel and the page cache are warm. Warm starts only: for a first start, run once on
a fresh machine or venv and read the first number.
"""

import argparse
import re
import statistics
import sys
import time
from datetime import datetime

import httpx
from server_process import REPO, ServerProcess

sys.path.insert(0, str(REPO))  # --breakdown imports this checkout's engine, as server.py does

ENGINE_LINE = re.compile(
    r"engine built in ([\d.]+)s: model config ([\d.]+)s, tokenizer ([\d.]+)s, "
    r"model and KV cache ([\d.]+)s"
)


def log_time(log: str, pattern: str) -> float:
    """Wall-clock time (epoch seconds) of the first log line matching `pattern` (asctime format)."""
    line = re.search(rf"^(\S+ \S+) .*{pattern}", log, re.M)
    return datetime.strptime(line.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def one_start(server_args: list[str]) -> dict[str, float]:
    """Spawns the server, polls /health every 10 ms; returns seconds per phase and to the first 200."""
    spawned = time.time()
    server = ServerProcess(server_args)
    try:
        with httpx.Client() as client:
            while client.get(f"{server.url}/health").status_code != 200:
                time.sleep(0.01)
        healthy = time.time()
        log = server.log()
    finally:
        server.stop()
    phases = {"total (to /health 200)": healthy - spawned}
    engine = ENGINE_LINE.search(log)
    ready = log_time(log, "ready: ")
    if engine:  # this revision logs the engine's phases
        built = log_time(log, "engine built in")
        total, cfg, tok, model = map(float, engine.groups())
        phases |= {
            "python + imports": built - total - spawned,
            "model config": cfg,
            "tokenizer": tok,
            "model and KV cache": model,
            "app + uvicorn": ready - built,
        }
    phases["first /health"] = healthy - ready
    return phases


def breakdown() -> dict[str, float]:
    """Each engine start-up step timed in this process, with the engine's own functions."""
    times, t = {}, time.perf_counter()

    def lap(name):
        nonlocal t
        times[name] = time.perf_counter() - t
        t = time.perf_counter()

    import torch

    lap("import torch")
    import transformers  # noqa: F401

    lap("import transformers")
    import api.cli  # noqa: F401
    from engine.worker import host_memory
    from models.attention import make_backend
    from models.config import ModelShape
    from models.loader import iter_weights, load_config, load_tokenizer, materialize, resolve_model
    from models.quantization.gguf import GGUFConfig
    from models.registry import get_model_class

    lap("import the server")
    model_path = resolve_model(None)
    cfg = load_config(model_path)
    lap("model config (GGUF metadata)")
    load_tokenizer(model_path)
    lap("tokenizer (from the GGUF's metadata)")
    shape = ModelShape.from_hf(cfg)
    backend = make_backend(None, torch.device("cpu"), torch.bfloat16, shape, 16)
    lap(f"attention backend ({type(backend).__name__}, C kernel build check)")
    cls, kwargs = get_model_class(cfg)
    with torch.device("meta"):
        model = cls(cfg, shape, backend, cfg.max_position_embeddings, quant_config=GGUFConfig(), **kwargs)
    model = materialize(model, torch.device("cpu"), torch.bfloat16)
    lap("model build (meta, materialize)")
    model.load_weights(iter_weights(model_path, quantized=True))
    lap("weights (quantized blocks copied from the file, repacked for VNNI)")
    host_memory.zeros(((2 << 30) // 4,), torch.float32)
    lap("KV cache, 2 GiB (host_memory.zeros)")
    torch.zeros((2 << 30) // 4, dtype=torch.float32)
    lap("(for comparison: torch.zeros of 2 GiB)")
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="warm starts to take the median of (default: %(default)s)")
    ap.add_argument("--breakdown", action="store_true", help="also time each step in this process")
    ap.add_argument("server_args", nargs="*", help="server.py flags after --")
    args = ap.parse_args()
    one_start(args.server_args)  # warms the compiled kernel and the page cache
    runs = [one_start(args.server_args) for _ in range(args.runs)]
    print(f"{'phase':<28}" + "".join(f"{f'run {i + 1}':>9}" for i in range(len(runs))) + f"{'median':>9}")
    for phase in runs[0]:
        values = [r[phase] for r in runs]
        print(f"{phase:<28}" + "".join(f"{v:9.2f}" for v in values) + f"{statistics.median(values):9.2f}")
    if args.breakdown:
        print("\nin-process breakdown (seconds):")
        for name, seconds in breakdown().items():
            print(f"  {name:<50}{seconds:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
