"""An exception inside an engine step fails only the requests of that step (500, or an error event
in a stream), is logged with its traceback, and the server keeps serving. The fault is injected
into the model runner of an in-process server (uvicorn in a thread, real HTTP)."""

import logging
import threading
import time

import httpx
import openai
import orjson
import pytest
import uvicorn

from api.app import build_app
from api.settings import ServerSettings
from engine import AsyncEngine, EngineConfig


@pytest.fixture(scope="module")
def faulty():
    """(engine, base URL) of a server whose next model step can be made to fail."""
    engine = AsyncEngine(EngineConfig(dtype="float32", kv_cache_memory=64 << 20, max_model_len=512))
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(engine, ServerSettings(served_model_name="smol")), host="127.0.0.1", port=0, log_config=None
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "in-process server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield engine, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)
    assert not engine.is_alive


def fail_next_step(engine) -> None:
    executor = engine.engine.engine_core.executor
    execute = executor.execute_model

    def fail_once(*args, **kwargs):
        executor.execute_model = execute
        raise RuntimeError("injected fault")

    executor.execute_model = fail_once


async def test_failed_step_gives_500_and_server_keeps_serving(faulty, caplog):
    engine, url = faulty
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        fail_next_step(engine)
        with caplog.at_level(logging.ERROR):
            r = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "Traceback" not in r.text and "injected" not in r.text
        assert any(rec.exc_info and "injected fault" in str(rec.exc_info[1]) for rec in caplog.records)
        assert (await http.get("/health")).status_code == 200
        r = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


async def test_failed_step_mid_stream_sends_error_event(faulty):
    engine, url = faulty
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async with http.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 50,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: {")  # the role chunk
            fail_next_step(engine)
            events = [line async for line in lines if line]
        assert events[-1] == "data: [DONE]"
        error = orjson.loads(events[-2].removeprefix("data: "))["error"]
        assert error["type"] == "server_error" and error["code"] is None
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as sdk:
        fail_next_step(engine)
        with pytest.raises(openai.APIError):
            async for _ in await sdk.completions.create(model="smol", prompt="Hi", max_tokens=5, stream=True):
                pass
        r = await sdk.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
