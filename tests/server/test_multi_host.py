"""Scale-out across real network hosts (network namespaces on one bridge, the test's client on a link of
its own; tests/netns.py): two data-parallel replicas on two hosts behind vllm-router on a third
(cache-aware routing), then one replica host's link cut during streams; a prefill server and a decode
server on two hosts with the prompt's KV pulled by NIXL over UCX's TCP transport, then the prefill server
killed before the pull; the two tensor-parallel ranks, then the two pipeline stages, of one engine on two
hosts (node 0 serving, node 1 headless), then node 1's link cut during a stream. Hosts are made and removed here."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from netns import Network, skip_reason

pytest.importorskip("vllm_router", reason="needs the [router] extra")
pytest.importorskip("nixl", reason="needs the [kv] extra")
_why = skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_why is not None, reason=_why or "")]

from server_harness import ROOT, MetricsReader, cli_args, wait_healthy  # noqa: E402

from api.data_parallel import HEALTH_CHECK_INTERVAL, router_command  # noqa: E402
from engine import SamplingParams  # noqa: E402

ENGINE = cli_args(kv_cache_memory=128 << 20, max_model_len=1024)
PORT = 8000
STREAM_END_TIMEOUT = 45  # seconds: the router's request timeout, the bound on how long a cut host's stream lasts


@pytest.fixture(scope="module")
def fleet():
    with Network(3) as net:
        replicas = [f"http://{net.addr(i)}:{PORT}" for i in range(2)]
        procs = [
            net.popen(
                i,
                [
                    sys.executable,
                    "-m",
                    "api.cli",
                    *ENGINE,
                    "--host",
                    net.addr(i),
                    "--port",
                    str(PORT),
                    "--data-parallel-rank",
                    str(i),
                ],
                cwd=ROOT,
                # int8 activations (the default outside the exact-token tests): the healthy host's long streams
                # end well within the router's timeout on one thread
                env=os.environ | {"OMP_NUM_THREADS": "1", "MINIVLLM_GGUF_ACTIVATIONS": "int8"},
            )
            for i in range(2)
        ]
        for url in replicas:
            wait_healthy(url, procs)
        router = net.popen(
            2,
            router_command(net.addr(2), PORT, replicas, "cache_aware")
            + ["--request-timeout-secs", str(STREAM_END_TIMEOUT)],
            cwd=ROOT,
        )
        url = f"http://{net.addr(2)}:{PORT}"
        wait_healthy(url, procs + [router], timeout=60)
        yield net, url, replicas


async def _served(replicas: list[str]) -> list[float]:
    counts = []
    for rank, url in enumerate(replicas):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            m = await MetricsReader(client).scrape()
            counts.append(
                sum(v for k, v in m.items() if k.startswith(f"vllm:request_success_total{{engine={rank},")) + 0.0
            )
    return counts


async def test_replicas_on_two_hosts_behind_the_router_on_a_third(fleet):
    net, url, replicas = fleet
    async with httpx.AsyncClient(base_url=url, timeout=120) as router:
        before = await _served(replicas)
        body = {"prompt": "The history of the city begins " * 20, "max_tokens": 8, "temperature": 0}
        answers = [await router.post("/v1/completions", json=body) for _ in range(3)]
        assert [a.status_code for a in answers] == [200] * 3
        assert all(a.json()["choices"][0]["text"] for a in answers)
        after = await _served(replicas)
    # cache-aware routing: the three requests with one prefix went to one host
    assert sorted(b - a for a, b in zip(before, after)) == [0, 3]


async def _stream(client: httpx.AsyncClient, i: int) -> tuple[str, float]:
    """One long stream through the router; ("done" | "error: ...", seconds it took to end)."""
    start = time.monotonic()
    # prompts without a common prefix, so cache-aware routing spreads them over both hosts by load
    subject = ["Apples", "Rivers", "Quantum", "Jazz", "Glaciers", "Poetry"][i]
    body = {
        "prompt": f"{subject}: once upon a time",
        "max_tokens": 600,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"error: status {r.status_code}", time.monotonic() - start
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "done", time.monotonic() - start
                if line.startswith("data: ") and '"error"' in line[:20]:
                    return f"error: {line[:120]}", time.monotonic() - start
        return "error: ended without [DONE]", time.monotonic() - start
    except httpx.HTTPError as e:
        return f"error: {e!r}", time.monotonic() - start


async def test_a_cut_host_ends_its_streams_and_the_router_moves_on(fleet):
    net, url, replicas = fleet
    async with httpx.AsyncClient(base_url=url, timeout=STREAM_END_TIMEOUT * 3) as router:
        streams = [asyncio.create_task(_stream(router, i)) for i in range(6)]
        await asyncio.sleep(3)  # the streams are running on both hosts
        net.cut(0)
        cut_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*streams), STREAM_END_TIMEOUT * 2)
        ended = time.monotonic() - cut_at
        # host 0's streams cannot finish: the router closes them (vllm-router sends no error event, the
        # client sees the chunked body cut short); host 1's finish
        outcomes = {r == "done" for r, _ in results}
        assert outcomes == {True, False}, results
        assert ended < STREAM_END_TIMEOUT + 15, results

        # new requests: 5xx at most until the router's health checks take host 0 out, then only 200s
        deadline = time.monotonic() + 6 * HEALTH_CHECK_INTERVAL + STREAM_END_TIMEOUT
        body = {"prompt": "Still there?", "max_tokens": 2}
        while (r := await router.post("/v1/completions", json=body)).status_code != 200:
            assert r.status_code >= 500 and time.monotonic() < deadline, (r.status_code, r.text)
            await asyncio.sleep(1)
        statuses = [
            (await router.post("/v1/completions", json={"prompt": f"q{i}", "max_tokens": 2})).status_code
            for i in range(6)
        ]
        assert statuses == [200] * 6

    # once the cable is back, the cut host has finished or aborted those streams: no KV block held
    net.restore(0)
    deadline = time.monotonic() + 120
    async with httpx.AsyncClient(base_url=replicas[0], timeout=10) as host0:
        while True:
            m = await MetricsReader(host0).scrape()
            if m["vllm:kv_cache_usage_perc{engine=0}"] == 0 and m["vllm:num_requests_running{engine=0}"] == 0:
                break
            assert time.monotonic() < deadline, m
            await asyncio.sleep(1)


@pytest.fixture(scope="module")
def pd_hosts():
    """A kv_producer on host 0 and a kv_consumer on host 1; UCX restricted to TCP on the host's eth0 (on one
    machine it would otherwise pick shared memory, which namespaces do not separate, or advertise the
    host's loopback address too, where the peer would reach itself)."""
    with Network(2) as net:
        env = os.environ | {"OMP_NUM_THREADS": "1", "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
        urls, procs = [], []
        for i, role in enumerate(["kv_producer", "kv_consumer"]):
            config = {
                "kv_connector": "NixlConnector",
                "kv_role": role,
                "kv_ip": net.addr(i),
                "kv_connector_extra_config": {"abort_request_timeout": 10, "handshake_timeout": 10},
            }
            procs.append(
                net.popen(
                    i,
                    [
                        sys.executable,
                        "-m",
                        "api.cli",
                        *ENGINE,
                        "--host",
                        net.addr(i),
                        "--port",
                        str(PORT),
                        "--kv-transfer-config",
                        json.dumps(config),
                    ],
                    cwd=ROOT,
                    env=env,
                )
            )
            urls.append(f"http://{net.addr(i)}:{PORT}")
        for url in urls:
            wait_healthy(url, procs)
        yield net, urls, procs


async def _prefill(client: httpx.AsyncClient, url: str, prompt: str) -> dict:
    r = await client.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


async def test_decode_host_pulls_the_prompt_from_the_prefill_host(pd_hosts):
    net, (prefill, decode), _ = pd_hosts
    prompt = "The committee met on Tuesday to review the budget for the coming year, and after " * 3
    async with httpx.AsyncClient(timeout=120) as client:
        reference = (
            await client.post(f"{prefill}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
        ).json()["choices"][0]["text"]
        params = await _prefill(client, prefill, prompt)
        assert params["remote_host"] == net.addr(0)
        r = await client.post(
            f"{decode}/v1/completions",
            json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "kv_transfer_params": params},
        )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == body["usage"]["prompt_tokens"] - 1


async def test_prefill_host_killed_before_the_pull_fails_the_request_and_frees_its_blocks(pd_hosts):
    net, (prefill, decode), procs = pd_hosts
    async with httpx.AsyncClient(timeout=120) as client:
        params = await _prefill(client, prefill, "A different prompt about rivers and mountains, " * 4)
        procs[0].send_signal(signal.SIGKILL)  # the prefill server dies with the blocks pinned
        procs[0].wait(30)
        start = time.monotonic()
        r = await client.post(
            f"{decode}/v1/completions",
            json={
                "prompt": "A different prompt about rivers and mountains, " * 4,
                "max_tokens": 4,
                "kv_transfer_params": params,
            },
        )
        assert time.monotonic() - start < 60
        assert r.status_code == 500 and r.json()["error"]["code"] == "kv_transfer_failed", r.text
        assert net.addr(0) in r.json()["error"]["message"]
    async with httpx.AsyncClient(base_url=decode, timeout=10) as client:
        m = await MetricsReader(client).scrape()
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0, m


# ---------------------------------------------------------------------------------------------
# Tensor parallelism across hosts
# ---------------------------------------------------------------------------------------------

TP_TIMEOUT = 15  # --distributed-timeout-seconds: how long a step may wait in a collective for a cut-off rank


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, llm):
    """A tiny random Llama-3 (4 query / 2 KV heads: one KV head per rank at TP=2), a prompt, and its TP=1
    greedy tokens up to the first near tie (top-two logits within 1e-3, where TP=2's summation order may
    pick the other), as (number of tokens, text)."""
    from conftest import make_llm

    from scripts.make_tiny_model import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama3")
    save_tiny_model("llama3", path, llm.tokenizer, num_key_value_heads=2)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    out = make_llm(model=str(path)).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    gaps = [lp.top_logprobs[0][1] - lp.top_logprobs[1][1] for lp in out.logprobs]
    n = next((i for i, gap in enumerate(gaps) if gap < 1e-3), len(gaps))
    assert n >= 4, gaps
    return path, prompt, (n, llm.tokenizer.decode(out.token_ids[:n]))


@pytest.mark.parametrize(
    "flag,rank_1",
    [("--tensor-parallel-size", "tensor-parallel rank 1"), ("--pipeline-parallel-size", "rank 1 (pipeline stage 1)")],
)
async def test_ranks_on_two_hosts_then_one_cut_off(flag, rank_1, tiny_llama, tmp_path):
    """Tensor parallelism (each host one half of every layer), then pipeline parallelism (each host one of
    the two layers, a stage)."""
    path, prompt, (num_tokens, expected) = tiny_llama
    with Network(2) as net:
        common = [
            *ENGINE,
            "--model",
            str(path),
            flag,
            "2",
            "--nnodes",
            "2",
            "--master-addr",
            net.addr(0),
            "--master-port",
            "29501",
            "--distributed-timeout-seconds",
            str(TP_TIMEOUT),
        ]
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(2)]
        node1 = net.popen(
            1,
            [sys.executable, "-m", "api.cli", *common, "--node-rank", "1", "--headless"],
            cwd=ROOT,
            env=env,
            stdout=logs[1],
            stderr=subprocess.STDOUT,
        )  # first: it waits for rank 0
        node0 = net.popen(
            0,
            [sys.executable, "-m", "api.cli", *common, "--host", net.addr(0), "--port", str(PORT)],
            cwd=ROOT,
            env=env,
            stdout=logs[0],
            stderr=subprocess.STDOUT,
        )
        url = f"http://{net.addr(0)}:{PORT}"
        wait_healthy(url, [node0, node1], timeout=180)
        log = (tmp_path / "node0.log").read_text()
        assert f"{rank_1} of 2: on {net.addr(1)}" in log, log[-3000:]

        async with httpx.AsyncClient(base_url=url, timeout=TP_TIMEOUT * 4) as http:
            r = await http.post(
                "/v1/completions",
                json={"prompt": prompt, "max_tokens": num_tokens, "temperature": 0, "ignore_eos": True},
            )
            assert r.json()["choices"][0]["text"] == expected

            # node 1's cable pulled mid-stream: the step waits out the collective timeout, the stream
            # ends with an error event, and the server exits naming the silent rank's host
            async with http.stream(
                "POST",
                "/v1/completions",
                json={"prompt": prompt, "max_tokens": 600, "ignore_eos": True, "stream": True},
            ) as r:
                lines = r.aiter_lines()
                assert (await anext(lines)).startswith("data: {")
                net.cut(1)
                cut_at = time.monotonic()
                events = [line async for line in lines if line]
        assert '"type":"server_error"' in events[-2] and events[-1] == "data: [DONE]", events[-3:]
        assert node0.wait(60) == 1
        assert time.monotonic() - cut_at < TP_TIMEOUT + 30
        log = (tmp_path / "node0.log").read_text()
        assert re.search(
            rf"shutting down: {re.escape(rank_1)} on {re.escape(net.addr(1))} sent no heartbeat "
            rf"for \d+ s \(host down or cut off\)",
            log,
        ), log[-3000:]
        # node 1 sees rank 0 no more: its rank exits on its own, and so does the headless launcher
        assert node1.wait(60) == 1
        log = (tmp_path / "node1.log").read_text()
        assert f"stopping: rank 0 at {net.addr(0)}:29501 has not answered for 10 s" in log, log[-3000:]
        for f in logs:
            f.close()
