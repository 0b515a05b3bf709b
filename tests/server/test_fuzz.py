"""scripts/fuzz.py: schemathesis drives every endpoint from /openapi.json (a few hundred valid and invalid
requests); no 5xx, every error has OpenAI's error body, /health stays 200, and the server ends idle."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from fuzz_checks import openai_error_body  # noqa: E402


def response(status: int, body) -> SimpleNamespace:
    return SimpleNamespace(status_code=status, json=lambda: body, text=str(body))


def test_error_body_check_rejects_other_shapes():
    check = openai_error_body
    good = {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    assert check(None, response(400, good), None) is None and check(None, response(200, {}), None) is None
    for bad in [{"detail": "Not Found"}, {"error": "m"}, {"error": {"message": "m", "type": "t"}}]:
        with pytest.raises(AssertionError):
            check(None, response(404, bad), None)
    ollama = SimpleNamespace(path="/api/chat")  # Ollama's routes answer {"error": "..."}
    assert check(None, response(400, {"error": "m"}), ollama) is None
    for bad in [good, {"error": "m", "extra": 1}]:
        with pytest.raises(AssertionError):
            check(None, response(400, bad), ollama)


@pytest.mark.slow
def test_fuzz_script_passes():
    run = subprocess.run(
        [sys.executable, "scripts/fuzz.py", "--max-examples", "15", "--phases", "fuzzing", "--seed", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0 and "PASS" in run.stdout, run.stdout[-6000:] + run.stderr[-2000:]
    generated = int(run.stdout.split(" generated")[0].rsplit(None, 1)[-1])
    assert generated >= 200
