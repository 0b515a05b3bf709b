"""llama.cpp's own server compatibility tests (release 11434, `tools/server/tests/unit/test_compat_anthropic.py` and
`test_compat_oai_responses.py`) run against this server in their external mode, as a user of either server would
judge them: the Anthropic Messages and OpenAI Responses shapes, streamed and not, tools, thinking, token counting.

The tests name the model "test" (and "gpt-4.1"), as llama-server accepts any name; this server is started with
those among its `--served-model-name`s (vLLM's flag, several names), with the chat template the thinking tests ask
llama-server for (llama.cpp's `models/templates/Qwen-Qwen3-0.6B.jinja`, which renders past reasoning; the default
model speaks its ChatML) and `--reasoning-parser qwen3`. Tests that need an image model, a reasoning model (they
download DeepSeek-R1-Distill-Qwen-7B for llama-server) or the text of llama.cpp's own test model are reported like
the others: the summary lists every failure with its first assertion line.

Usage:
  python scripts/llama_cpp_compat.py                          # default model, prints passed / failed
  python scripts/llama_cpp_compat.py --server-args --reasoning-parser qwen3 --model DIR
  python scripts/llama_cpp_compat.py --url http://127.0.0.1:8000   # a server already running (names as above)
Exit status: 0 when at least --min-pass tests pass.
"""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from scripts import llama_cpp  # noqa: E402
from scripts.server_process import ServerProcess  # noqa: E402

FILES = ("unit/test_compat_anthropic.py", "unit/test_compat_oai_responses.py")
NAMES = ["SmolLM2-135M-Instruct", "test", "gpt-4.1"]


def run_suite(url: str, tests_dir: Path, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """(passed test ids, failed test id -> first error line) of the compat files against `url`."""
    parsed = urlparse(url)
    env = os.environ | {"DEBUG_EXTERNAL": "1", "PORT": str(parsed.port), "COLUMNS": "300"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-q", *FILES, *extra],
        cwd=tests_dir,
        env=env,
        capture_output=True,
        text=True,
    )
    passed = re.findall(r"^PASSED (\S+)", done.stdout, re.M)
    failed = {m[0]: m[1] for m in re.findall(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", done.stdout, re.M)}
    if not passed and not failed:
        raise RuntimeError(f"the suite did not run:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return passed, failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (started with the names above) instead of starting one")
    ap.add_argument("--min-pass", type=int, default=0, help="exit 1 when fewer tests pass")
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more flags for server.py")
    args = ap.parse_args()
    tests_dir = llama_cpp.fetch_source() / "tools" / "server" / "tests"
    for module in ("wget", "openai", "requests"):  # what the suite's utils.py imports
        try:
            __import__(module)
        except ImportError:
            sys.exit(f"llama.cpp's test suite needs `pip install {module}`")
    if args.url:
        passed, failed = run_suite(args.url, tests_dir, [])
    else:
        template = tests_dir.parents[2] / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja"
        flags = ["--served-model-name", *NAMES, "--chat-template", str(template), "--reasoning-parser", "qwen3"]
        with ServerProcess([*flags, *args.server_args]) as server:
            passed, failed = run_suite(server.url, tests_dir, [])
    for test, why in sorted(failed.items()):
        print(f"FAILED {test.split('::')[-1]}: {why}")
    total = len(passed) + len(failed)
    print(f"llama.cpp compat suite ({', '.join(f.split('/')[-1] for f in FILES)}): {len(passed)} of {total} passed")
    return 0 if len(passed) >= args.min_pass else 1


if __name__ == "__main__":
    sys.exit(main())
