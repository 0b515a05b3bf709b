"""server.py's flags: --help, --api-key, --served-model-name, --max-queue-len (503 + Retry-After),
--max-request-body-bytes, --chat-template, --no-dashboard, the startup log, the memory report on
SIGUSR1, and a clean exit on SIGINT with a
request in flight that outlives --shutdown-timeout. One extra server runs every test here, in order;
the last one stops it."""

import asyncio
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # starts servers and processes

pytest_plugins = ["server_harness"]

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
LONG = {"max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def aux(server_factory, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    return server_factory(
        "--api-key",
        KEY,
        "--served-model-name",
        "smol",
        "smol-alias",
        "--max-queue-len",
        "1",
        "--max-num-seqs",
        "1",
        "--max-request-body-bytes",
        "4096",
        "--chat-template",
        str(template),
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "64M",
        "--dtype",
        "float32",
        "--no-enable-prefix-caching",
        "--no-dashboard",
        "--shutdown-timeout",
        "5",
    )


@pytest.fixture
async def client(aux):
    async with httpx.AsyncClient(base_url=aux.url, headers=AUTH, timeout=60) as c:
        yield c


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, "server.py", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in [
        "--model",
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--kv-cache-memory",
        "--gpu-memory-utilization",
        "--dtype",
        "--no-enable-prefix-caching",
        "--max-queue-len",
        "--chat-template",
        "--no-dashboard",
        "--shutdown-timeout",
        "--log-level",
    ]:
        assert flag in out
    bad = subprocess.run([sys.executable, "server.py", "--block-size", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "block_size must be >= 1" in bad.stderr


def test_startup_log(aux):
    log = aux.log()
    assert "serving SmolLM2-135M-Instruct as 'smol' or 'smol-alias': float32 on cpu" in log
    assert "KV blocks of 16 tokens" in log and "max_model_len 512" in log
    assert f"ready: {aux.url} (OpenAI base_url {aux.url}/v1)" in log


async def test_sigusr1_logs_a_memory_report(aux):
    """`kill -USR1`: one line with the resident set, glibc's arenas and bytes, and whether Python traces;
    the server goes on serving."""
    line = aux.memory_report(timeout=5)
    assert re.fullmatch(
        r"rss [\d.]+ MiB; malloc: \d+ arenas, [\d.]+ MiB from the system \([\d.]+ in arenas \+ [\d.]+ mmapped\), "
        r"[\d.]+ MiB in use, [\d.]+ MiB free in arenas; python: not traced \(PYTHONTRACEMALLOC=1 to trace\)",
        line,
    ), line
    rss = float(line.split()[1])
    assert abs(rss - aux.rss_bytes() / 2**20) < 0.2 * rss  # the process's own, not the test's
    async with httpx.AsyncClient(base_url=aux.url) as anonymous:
        assert (await anonymous.get("/health")).status_code == 200


async def test_api_key_required_except_probes(aux):
    async with httpx.AsyncClient(base_url=aux.url) as anonymous:
        for path in ["/health", "/metrics", "/version"]:
            assert (await anonymous.get(path)).status_code == 200, path
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}]:
            r = await anonymous.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (await anonymous.post("/tokenize", json={"prompt": "x"})).status_code == 401
    async with openai.AsyncOpenAI(base_url=f"{aux.url}/v1", api_key="wrong", max_retries=0) as sdk:
        with pytest.raises(openai.AuthenticationError):
            await sdk.models.list()


async def test_no_dashboard(client):
    for path in ("/dashboard", "/dashboard/events", "/dashboard/static/dashboard.js"):
        r = await client.get(path)
        assert r.status_code == 404 and r.json()["error"]["message"] == f"Invalid URL (GET {path})"


async def test_served_model_name(aux):
    """Several names (vLLM's --served-model-name NAME [NAME ...]): each accepted, the first reported."""
    async with openai.AsyncOpenAI(base_url=f"{aux.url}/v1", api_key=KEY, max_retries=0) as sdk:
        assert [m.id for m in (await sdk.models.list()).data] == ["smol", "smol-alias"]
        r = await sdk.completions.create(model="smol", prompt="Hi", max_tokens=2)
        assert r.model == "smol" and r.usage.completion_tokens <= 2
        r = await sdk.completions.create(model="smol-alias", prompt="Hi", max_tokens=2)
        assert r.model == "smol"
        with pytest.raises(openai.NotFoundError):
            await sdk.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)


async def test_body_limit(client):
    r = await client.post("/v1/completions", json={"prompt": "a" * 5000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


async def test_chat_template_file(client):
    tokens = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})).json()["tokens"]
    assert (await client.post("/detokenize", json={"tokens": tokens})).json()["prompt"] == "[user] Hi\n[assistant] "
    r = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tokens)


async def _first_chunk(lines) -> str:
    while not (line := await anext(lines)).startswith("data: {"):
        pass
    return line


async def test_queue_full_gets_503_with_retry_after(client, aux):
    """One sequence runs (--max-num-seqs 1) and one may wait (--max-queue-len 1): a third gets 503."""
    async with client.stream("POST", "/v1/completions", json={"prompt": "A"} | LONG) as running:
        await _first_chunk(running.aiter_lines())
        async with client.stream("POST", "/v1/completions", json={"prompt": "B"} | LONG) as waiting:
            assert waiting.status_code == 200
            r = await client.post("/v1/completions", json={"prompt": "C", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            assert (await client.get("/health")).status_code == 200
    # Both streams were abandoned, so both requests are aborted and the queue frees up soon.
    for _ in range(50):
        r = await client.post("/v1/completions", json={"prompt": "D", "max_tokens": 2})
        if r.status_code != 503:
            break
        await asyncio.sleep(0.1)
    assert r.status_code == 200


async def test_sigint_drains_then_aborts_in_flight_requests_and_exits_0(client, aux):
    """Runs last: stops the extra server. SIGINT starts the drain (new requests get 503); the request
    in flight (400 tokens on one sequence) outlives --shutdown-timeout 5 and is aborted."""
    async with client.stream("POST", "/v1/completions", json={"prompt": "Once"} | LONG) as stream:
        lines = stream.aiter_lines()
        await _first_chunk(lines)
        aux.proc.send_signal(signal.SIGINT)
        for _ in range(100):  # the signal is handled by the server's event loop soon
            r = await client.get("/health")
            if r.status_code == 503:
                break
            await asyncio.sleep(0.05)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "shutting_down"
        rest = [line async for line in lines if line]
    assert '"finish_reason":"abort"' in rest[-2] and rest[-1] == "data: [DONE]"
    assert aux.proc.wait(timeout=30) == 0
    assert "aborting 1 requests still in flight" in aux.log()
    with pytest.raises(httpx.ConnectError):
        await client.get("/health")
