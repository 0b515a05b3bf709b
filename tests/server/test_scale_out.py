"""Scale-out through vllm-router: `server.py --data-parallel-size 2` (replicas behind the router, the
endpoints the router calls, metrics per replica, a clean stop), and disaggregated prefill/decode (a
kv_producer and a kv_consumer server behind `vllm-router --vllm-pd-disaggregation`: the same greedy
text as one server, the prompt's K/V pulled over NIXL instead of computed, failures that free every
block). Every process started here is stopped here."""

import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.register_assert_rewrite("server_harness")  # imported here for its classes, before pytest loads it as a plugin
from server_harness import ROOT, MetricsReader, ServerProcess, cli_args, wait_healthy  # noqa: E402

from api.data_parallel import HEALTH_CHECK_INTERVAL  # noqa: E402

pytest.importorskip("vllm_router", reason="needs the [router] extra")
pytest.importorskip("nixl", reason="needs the [kv] extra")
pytestmark = pytest.mark.slow

ENGINE = cli_args(dtype="float32", kv_cache_memory=256 << 20, max_model_len=1024)
ABORT_TIMEOUT = 10  # seconds the producer keeps blocks nobody pulls
MAX_TOKENS = 16


def _workload() -> list[list[int]]:
    with open(os.path.join(ROOT, "scripts", "data", "workload.jsonl")) as f:
        return [json.loads(line)["prompt_token_ids"] for line in f if line.strip()]


def _free_port() -> int:
    from api.data_parallel import free_port

    return free_port()


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


# ---------------------------------------------------------------------------------------------
# Data parallel
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dp():
    proc = ServerProcess(
        ["--data-parallel-size", "2", "--router-policy", "cache_aware", *ENGINE],
        timeout=300,
        ready_pattern=r"ready: (http://127\.0\.0\.1:\d+) \(OpenAI base_url .*vllm-router",
    )
    yield proc
    proc.stop()


async def test_data_parallel_replicas_behind_the_router(dp):
    log = dp.log()
    replicas = re.findall(r"replica (\d): pid (\d+) on (http://127\.0\.0\.1:\d+), cores (\S+)", log)
    assert [r[0] for r in replicas] == ["0", "1"]
    assert replicas[0][3] != replicas[1][3] or os.cpu_count() == 1, "each replica gets its own cores"
    prompt = _workload()[30][:200]
    async with httpx.AsyncClient(base_url=dp.url, timeout=120) as router:
        r = await router.get("/v1/models")
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        answers = [await router.post("/v1/completions", json=body) for _ in range(3)]
        assert all(a.status_code == 200 for a in answers)
        assert len({a.json()["choices"][0]["text"] for a in answers}) == 1
        chat = await router.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Name three fruits."}],
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
            },
        )
        assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]")

    successes, hits = 0, []
    for rank, (_, _, url, _) in enumerate(replicas):
        async with httpx.AsyncClient(base_url=url, timeout=60) as replica:
            load = (await replica.get("/get_load")).json()
            assert load == [{"dp_rank": rank, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
            info = (await replica.get("/get_server_info")).json()
            assert info["data_parallel_rank"] == rank and info["kv_block_size"] == 16
            assert info["max_model_len"] == 1024 and info["num_kv_blocks"] > 0
            rendered = (await replica.post("/v1/completions/render", json={"prompt": "Hello world"})).json()
            tokens = (await replica.post("/tokenize", json={"prompt": "Hello world"})).json()["tokens"]
            assert rendered[0]["token_ids"] == tokens and rendered[0]["model"] == "SmolLM2-135M-Instruct"
            messages = [{"role": "user", "content": "Hi"}]
            rendered = (await replica.post("/v1/chat/completions/render", json={"messages": messages})).json()
            tokens = (await replica.post("/tokenize", json={"messages": messages})).json()["tokens"]
            assert rendered["token_ids"] == tokens
            m = await MetricsReader(replica).scrape()
            successes += sum(v for k, v in m.items() if k.startswith(f"vllm:request_success_total{{engine={rank},"))
            hits.append(m[f"vllm:prefix_cache_hits_total{{engine={rank}}}"])
    # every replica's /metrics carries its rank, so the scrapes add up to what the router served
    assert successes == 4
    # the three equal prompts went to one replica (the router's prefix tree), the later two hit its cache
    assert sorted(hits)[0] == 0 and sorted(hits)[1] >= 2 * ((len(prompt) - 1) // 16 * 16)


def test_data_parallel_survives_a_dead_replica_and_stops_everything_on_sigterm(dp):
    pids = [int(p) for p in re.findall(r"(?:replica \d|vllm-router): pid (\d+)", dp.log())]
    assert len(pids) == 3 and _pids_alive(pids) == pids
    os.kill(pids[1], signal.SIGKILL)  # replica 1 dies: logged, not restarted, the router serves on
    deadline = time.monotonic() + 30
    while f"replica 1 (pid {pids[1]}) exited with status -9; not restarted" not in dp.log():
        assert time.monotonic() < deadline, dp.log()[-2000:]
        time.sleep(0.2)
    # Until the router's health checks (every HEALTH_CHECK_INTERVAL s) take the dead replica out, a
    # request it routes there fails with a 5xx; after that the live replica serves it.
    deadline = time.monotonic() + 6 * HEALTH_CHECK_INTERVAL
    while (
        r := httpx.post(f"{dp.url}/v1/completions", json={"prompt": "Still there?", "max_tokens": 2}, timeout=120)
    ).status_code != 200:
        assert r.status_code >= 500 and time.monotonic() < deadline, (r.status_code, r.text)
        time.sleep(1)
    assert dp.proc.poll() is None
    dp.proc.send_signal(signal.SIGTERM)
    assert dp.proc.wait(timeout=60) == 0
    assert "stopped the router and 2 replicas" in dp.log()
    assert _pids_alive(pids) == []  # the router and the live replica were stopped by PID


def test_data_parallel_needs_the_router_extra(monkeypatch, caplog):
    """Without vllm-router installed, the launcher names the extra to install (and starts nothing)."""
    from api import data_parallel
    from api.cli import make_parser

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm_router" else find(name, *a))
    assert data_parallel.serve(make_parser().parse_args(["--data-parallel-size", "2"]), []) == 1
    assert 'needs vllm-router: pip install -e ".[router]"' in caplog.text


# ---------------------------------------------------------------------------------------------
# Disaggregated prefill/decode
# ---------------------------------------------------------------------------------------------


def _kv_config(role: str, **extra) -> list[str]:
    config = {"kv_connector": "NixlConnector", "kv_role": role}
    if extra:
        config["kv_connector_extra_config"] = extra
    return ["--kv-transfer-config", json.dumps(config)]


class Router:
    """`vllm-router --vllm-pd-disaggregation` in front of one prefill and one decode server."""

    def __init__(self, prefill: str, decode: str):
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                self.url.rsplit(":", 1)[1],
                "--vllm-pd-disaggregation",
                "--prefill",
                prefill,
                "--decode",
                decode,
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(_free_port()),
                "--log-level",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_healthy(self.url, [self.proc], timeout=60)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def pd():
    with ThreadPoolExecutor(2) as pool:  # both servers load at once
        prefill = pool.submit(
            ServerProcess, [*ENGINE, *_kv_config("kv_producer", abort_request_timeout=ABORT_TIMEOUT)], timeout=180
        )
        decode = pool.submit(ServerProcess, [*ENGINE, *_kv_config("kv_consumer")], timeout=180)
        servers = [f.result() for f in (prefill, decode)]
    router = Router(servers[0].url, servers[1].url)
    yield servers[0], servers[1], router
    router.stop()
    # Both shut down at once, each sent one SIGTERM: a second one, sent while a server's interpreter is
    # tearing down (Python then restores the default handlers), would kill it with -15.
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(ServerProcess.stop, servers)) == [0, 0]


async def _metrics(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await MetricsReader(client).scrape()


def _delta(after: dict, before: dict, name: str) -> float:
    return after[name] - before.get(name, 0)


SOURCES = [
    f"vllm:prompt_tokens_by_source_total{{source={s}}}"
    for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
]
RECOMPUTED = "vllm:prompt_tokens_recomputed_total"


async def test_decode_that_cannot_reach_the_producer_fails_cleanly(pd):
    """A 5xx with the reason, and no block held on the decode server; the producer frees its pinned
    blocks after the timeout (checked by the last test, so the wait overlaps the others)."""
    prefill, decode, _ = pd
    prompt = _workload()[40][:100]
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(
            f"{prefill.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )
        params = r.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == 7
        closed = _free_port()  # nobody listens there
        for stream in (False, True):
            r = await client.post(
                f"{decode.url}/v1/completions",
                json={
                    "prompt": prompt,
                    "max_tokens": 4,
                    "stream": stream,
                    "kv_transfer_params": params | {"remote_port": closed},
                },
            )
            error = r.json()["error"] if not stream else json.loads(r.text.split("data: ")[1])["error"]
            assert r.status_code == (200 if stream else 500)  # a stream has sent its 200 already
            assert error["code"] == "kv_transfer_failed" and f"127.0.0.1:{closed}" in error["message"]
        bad = await client.post(
            f"{decode.url}/v1/completions", json={"prompt": prompt[:50], "max_tokens": 4, "kv_transfer_params": params}
        )
        assert bad.status_code == 400 and "remote_block_ids has 7 blocks; this prompt fills 4" in bad.text
    m = await _metrics(decode.url)
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:nixl_num_failed_transfers_total"] == 2


async def test_pull_instead_of_prefill(pd):
    """Prefill server, then decode server, by hand: the decode computes one prompt position (the last,
    for its logits, as vLLM does) and the producer frees the blocks once they are pulled."""
    prefill, decode, _ = pd
    prompt = _workload()[41][:77]
    async with httpx.AsyncClient(timeout=120) as client:
        reference = (
            await client.post(
                f"{prefill.url}/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            )
        ).json()
        r = await client.post(
            f"{prefill.url}/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        )
        params = r.json()["kv_transfer_params"]
        assert (await _metrics(prefill.url))["vllm:kv_cache_usage_perc"] > 0  # pinned
        before = await _metrics(decode.url)
        r = (
            await client.post(
                f"{decode.url}/v1/completions",
                json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "kv_transfer_params": params},
            )
        ).json()
    assert r["choices"][0]["text"] == reference["choices"][0]["text"]
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
    after = await _metrics(decode.url)
    assert [_delta(after, before, s) for s in SOURCES] == [1, 0, len(prompt)] and _delta(after, before, RECOMPUTED) == 1
    async with httpx.AsyncClient(base_url=prefill.url) as client:
        await MetricsReader(client).wait_until_idle(timeout=10)  # the pull freed the pinned blocks


def _near_tie_divergence(ours: str, reference: dict) -> bool:
    """True if `ours` follows the reference tokens up to a step where the reference's two best
    tokens were within 1e-3 in logprob (batch shapes may flip such a tie), or all the way."""
    logprobs, text = reference["logprobs"], ""
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
        if not ours.startswith(text + token):
            best = sorted(top.values(), reverse=True)
            return len(best) > 1 and best[0] - best[1] < 1e-3
        text += token
    return ours == text


@pytest.mark.parametrize("stream", [False, True])
async def test_pd_behind_the_router_matches_one_server(pd, stream):
    """16 concurrent requests through vllm-router in PD mode: the same greedy text as the prefill
    server alone, and the decode server computes no prompt token but the last of each."""
    prefill, decode, router = pd
    lengths = [1, 5, 16, 17, 31, 32, 33, 48, 64, 95, 120, 150, 180, 200, 256, 300]
    prompts = [ids[:n] for ids, n in zip(_workload(), lengths)]
    body = {"max_tokens": MAX_TOKENS, "temperature": 0}
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        references = await asyncio.gather(
            *(client.post(f"{prefill.url}/v1/completions", json=body | {"prompt": p, "logprobs": 2}) for p in prompts)
        )
        before = await _metrics(decode.url)

        async def one(prompt):
            r = await client.post(f"{router.url}/v1/completions", json=body | {"prompt": prompt, "stream": stream})
            assert r.status_code == 200, r.text
            if not stream:
                return r.json()["choices"][0]["text"]
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            return "".join(c["choices"][0]["text"] for c in chunks)

        texts = await asyncio.gather(*(one(p) for p in prompts))
    for text, reference in zip(texts, references):
        expected = reference.json()["choices"][0]
        assert text == expected["text"] or _near_tie_divergence(text, expected), (text, expected["text"])
    after = await _metrics(decode.url)
    local, hit, external = (_delta(after, before, s) for s in SOURCES)
    assert local == _delta(after, before, RECOMPUTED) == len(prompts)  # only the last position of each
    assert hit + external == sum(map(len, prompts))
    if not stream:  # first time the decode server sees these prompts: all of their K/V was pulled
        assert external == sum(map(len, prompts))
    for server in (prefill, decode):  # every block is back: pulled ones on the producer, finished ones here
        async with httpx.AsyncClient(base_url=server.url) as client:
            await MetricsReader(client).wait_until_idle(timeout=10)


async def test_unpulled_blocks_expire_on_the_producer(pd):
    """The blocks pinned for the unreachable decode (first test) are freed after the timeout."""
    prefill, _, _ = pd
    deadline = time.monotonic() + ABORT_TIMEOUT + 30
    while (m := await _metrics(prefill.url))["vllm:nixl_num_kv_expired_reqs_total"] < 1:
        assert time.monotonic() < deadline, m
        await asyncio.sleep(0.5)
    assert m["vllm:nixl_num_kv_expired_reqs_total"] == 1 and m["vllm:kv_cache_usage_perc"] == 0
    assert "no decode server pulled its KV blocks within 10 s" in prefill.log()
