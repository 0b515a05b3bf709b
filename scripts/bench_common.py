"""What the bench_* scripts share: workloads (requests read from a JSONL file, or synthetic random-token
prompts; every length in tokens of the model's tokenizer) and a record of where a result was measured."""

import json
import os
import platform
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "scripts" / "data"
DEFAULT_WORKLOAD = DATA_DIR / "workload.jsonl"
PREFIX_WORKLOAD = DATA_DIR / "prefix_workload.jsonl"


@dataclass
class Request:
    """One benchmark request: the prompt as token ids (and as text when the workload has it, for
    servers that take text) and the exact number of tokens to generate (EOS is ignored)."""

    prompt_token_ids: list[int]
    max_tokens: int
    prompt: str | None = None


def load_jsonl(path: str | Path, num_requests: int | None = None, output_len: int | None = None) -> list[Request]:
    """Reads requests from a JSONL file with `prompt_token_ids`, `max_tokens` and optionally `prompt`.

    num_requests: keep the first N (None = all). output_len: overrides every request's max_tokens.
    """
    reqs = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            reqs.append(Request(r["prompt_token_ids"], output_len or r["max_tokens"], r.get("prompt")))
            if num_requests is not None and len(reqs) == num_requests:
                break
    return reqs


def random_requests(num_requests: int, input_len: int, output_len: int, tokenizer, seed: int = 0) -> list[Request]:
    """Synthetic prompts of exactly `input_len` token ids drawn uniformly from the tokenizer's vocabulary,
    special tokens excluded (they would change how the model treats the prompt)."""
    special = set(tokenizer.all_special_ids)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special])
    rng = np.random.default_rng(seed)
    return [Request(rng.choice(vocab, input_len).tolist(), output_len) for _ in range(num_requests)]


def run_info() -> dict:
    """Date (UTC), git revision, machine and library versions, stored with every result."""

    def git(*args):
        # GIT_OPTIONAL_LOCKS=0: `git status` must not rewrite the index of a tree someone is working in.
        r = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
        )
        return r.stdout.strip() if r.returncode == 0 else None

    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_revision": git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def read_rate(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second this process reads memory at: the best of `repeats` sums of `nbytes` of float32, far
    larger than the caches, in memory advised for transparent huge pages as the engine's weights and KV cache
    are (engine/worker/host_memory.py; a tensor in 4 KiB pages read 10-30% slower here)."""
    import time

    import torch

    from engine.worker import host_memory

    x = host_memory.zeros((nbytes // 4,), torch.float32)
    host_memory.wait_for_prefault()
    x.fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best
