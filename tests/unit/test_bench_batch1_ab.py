"""scripts/bench_batch1_ab.py alternates two engine variants in one process and reports each one's times."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.kernels import cpu_kernels

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_batch1_ab.py"


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the layers do not fuse")
@pytest.mark.parametrize(
    "ab, names",
    [
        ("stack", ["one call per layer", "stack"]),
        ("fused", ["op by op", "fused"]),
        ("huge-pages", ["4 KiB pages", "huge pages"]),
    ],
)
def test_each_variant_runs_every_round(ab, names):
    args = ["--ab", ab, "--rounds", "2", "--depth", "24", "--output-len", "3", "--dtype", "float32", "--swap"]
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=True)
    lines = out.stdout.splitlines()
    rounds = [line.split()[2:-2] for line in lines if line.startswith("round")]
    # the --swap order (the second variant loaded and run first), reversed in the second round
    assert [" ".join(r) for r in rounds] == [*names, *names[::-1]]
    summary = json.loads(lines[-1])
    assert summary["ab"] == ab and set(summary) >= set(names)
    assert all(summary[n]["best_ms"] > 0 and summary[n]["median_ms"] >= summary[n]["best_ms"] for n in names)
