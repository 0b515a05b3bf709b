"""The GPU scripts start from any working directory and, without a GPU, stop with a clear message (their first
run on a GPU machine failed at `import engine`: the scripts folder, not the repository root, was on sys.path)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
@pytest.mark.parametrize(
    "script, message", [("gpu_check.py", "gpu_check needs a CUDA device"), ("gpu_e2e.py", "no CUDA device")]
)
def test_gpu_script_imports_and_refuses_without_cuda(tmp_path, script, message):
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1, run.stderr
    assert message in run.stderr, run.stderr
