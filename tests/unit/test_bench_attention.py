"""scripts/bench_attention.py runs every cache kind through the kernel and reports a step against its floor."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.kernels import cpu_kernels

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_attention.py"


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the CPU kernels are not built")
def test_bench_attention_reports_each_kind():
    kinds = ["bf16:bf16", "float:float", "float:int8", "bf16:fp8_e5m2"]
    args = ["--kinds", *kinds, "--seqs", "3", "--depth", "40", "--layers", "2", "--repeats", "1", "--bandwidth", "10"]
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert rows[0]["read_gb_s"] == 10.0
    assert [r["kind"] for r in rows[1:]] == kinds
    # K/V bytes of 2 layers x 3 sequences x 40 keys x 3 heads, K and V: 128 B a bfloat16 row, 256 float32, 72 int8
    # (64 codes and 2 scales), 64 fp8
    for r, row_bytes in zip(rows[1:], (128, 256, 72, 64)):
        nbytes = 2 * 3 * 40 * 3 * 2 * row_bytes
        assert r["kv_mb"] == round(nbytes / 1e6, 1) and r["floor_ms"] == round(1e3 * nbytes / 10e9, 2)
        assert r["step_ms"] > 0


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the CPU kernels are not built")
def test_bench_attention_runs_a_prompt_step():
    args = ["--prompt", "40", "--kinds", "bf16:bf16", "float:float", "--layers", "2", "--repeats", "1"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--bandwidth", "10"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = [json.loads(line) for line in out.stdout.splitlines()][1:]
    assert [(r["kind"], r["prompt"], r["layers"]) for r in rows] == [("bf16:bf16", 40, 2), ("float:float", 40, 2)]
    # 2 layers x 40^2 / 2 keys x 9 heads x 64 x 2 (QK and PV) multiply-adds in step_ms (both rounded: ms to 0.01,
    # GMAC/s to 0.1)
    macs = 2 * 40**2 / 2 * 9 * 64 * 2
    for r in rows:
        low, high = macs / (r["step_ms"] + 0.005) / 1e6, macs / max(r["step_ms"] - 0.005, 1e-6) / 1e6
        assert low - 0.05 <= r["gmac_s"] <= high + 0.05
