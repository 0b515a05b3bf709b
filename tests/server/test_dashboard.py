"""The dashboard on a real server with --api-key: the page and its feed over HTTP, the feed's rate limit,
llama.cpp-style `timings` in responses read through the openai SDK, and the page in headless Chromium
under 16 concurrent streams with a shared prefix (skipped, saying why, where Chromium is missing)."""

import asyncio
import shutil
import time

import httpx
import openai
import orjson
import pytest

from api.dashboard import histogram_quantile

pytestmark = pytest.mark.slow  # starts servers and processes

pytest_plugins = ["server_harness"]

KEY = "dash-key"
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {KEY}"}
PREFIX = "You are a helpful assistant. Answer in one short sentence, precisely and politely. " * 4
TIMINGS = {
    "queue_ms",
    "cache_n",
    "cached_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
    "preemptions",
}


@pytest.fixture(scope="module")
def dash():
    from server_harness import ServerProcess, cli_args  # imported as the plugin above, for its asserts

    # 128 tokens per step: the prompts below are prefilled in chunks, next to other requests' decodes
    proc = ServerProcess(
        [
            "--api-key",
            KEY,
            *cli_args(dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024, max_num_batched_tokens=128),
        ],
        timeout=180,
    )
    yield proc
    log = proc.log()
    assert proc.stop() == 0, log[-4000:]


@pytest.fixture
async def sdk(dash):
    async with openai.AsyncOpenAI(base_url=f"{dash.url}/v1", api_key=KEY, max_retries=0, timeout=300) as client:
        yield client


class EventReader:
    """Reads an SSE response's events as they arrive."""

    def __init__(self, response: httpx.Response):
        self._chunks = response.aiter_bytes()
        self._buffer = b""

    async def until(self, done, timeout: float = 120) -> list[tuple[float, dict]]:
        """(arrival time, payload) of each event read until `done(payloads read in this call)`."""
        events = []
        deadline = time.monotonic() + timeout
        while not (events and done([p for _, p in events])):
            assert time.monotonic() < deadline, f"gave up after {len(events)} events"
            while b"\n\n" not in self._buffer:
                self._buffer += await anext(self._chunks)
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:
                events.append((time.monotonic(), orjson.loads(b"\n".join(data))))
        return events


async def test_page_is_open_and_the_feed_needs_the_key(dash):
    async with httpx.AsyncClient(base_url=dash.url, timeout=60) as http:
        page = await http.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'src="dashboard/static/dashboard.js"' in page.text
        for asset in ("dashboard.js", "dashboard.css"):
            r = await http.get(f"/dashboard/static/{asset}")
            assert r.status_code == 200 and "://" not in r.text + page.text  # nothing fetched from elsewhere
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = await http.get("/dashboard/events", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (await http.get("/v1/models")).status_code == 401  # the rest of the API is still closed


async def test_feed_rate_limit_and_content(dash, sdk):
    async with httpx.AsyncClient(base_url=dash.url, headers=AUTH, timeout=120) as http:
        async with http.stream("GET", "/dashboard/events") as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = EventReader(response)
            idle = (await events.until(lambda ps: True))[0][1]
            assert idle["engine"]["num_running"] == 0 and idle["engine"]["kv"]["used"] == 0
            load = asyncio.gather(
                *(
                    sdk.completions.create(
                        prompt=PREFIX + f"Item {i}.",
                        max_tokens=40,
                        model=MODEL,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(4)
                )
            )
            start = time.monotonic()
            busy = await events.until(lambda ps: ps[-1]["engine"]["num_running"] == 4)
            done = await asyncio.wait_for(load, 300)
            rest = await events.until(
                lambda ps: ps[-1]["engine"]["num_running"] == 0 and ps[-1]["metrics"]["generation_tokens"] >= 160
            )
    events = busy + rest
    elapsed = events[-1][0] - start
    # at most one event per 0.2 s poll (+1 for the one in flight when we started counting)
    assert len(events) <= elapsed * 5 + 2, (len(events), elapsed)
    payloads = [p for _, p in events]
    running = next(p for p in payloads if p["engine"]["num_running"] == 4)
    rows = running["engine"]["requests"]
    assert {r["id"] for r in rows} == {f"{c.id}-0" for c in done}
    assert all(r["state"] in ("prefilling", "decoding") and r["prompt"] > 64 for r in rows)
    assert sum(r["cached"] for r in rows) >= 3 * 64  # the shared prefix: later requests hit the first's blocks
    assert running["engine"]["kv"]["shared"] >= 4
    assert payloads[-1]["engine"]["kv"]["used"] == payloads[-1]["engine"]["kv"]["shared"] == 0
    assert {r["id"] for r in payloads[-1]["engine"]["finished"]} <= {r["id"] for r in rows}
    assert sum(payloads[-1]["engine"]["steps"]["decode"]) >= 4 * 39
    metrics = payloads[-1]["metrics"]
    assert metrics["generation_tokens"] >= 160 and metrics["ttft"]["p50"] > 0 and metrics["tpot"]["p50"] > 0


def test_histogram_quantile_as_prometheus():
    buckets = [(0.1, 0.0), (0.2, 10.0), (0.4, 20.0), (float("inf"), 20.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.15)  # linear within (0.1, 0.2]
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.2 + 0.2 * 9.8 / 10)
    assert histogram_quantile(0.99, [(0.1, 1.0), (float("inf"), 10.0)]) == 0.1  # in +Inf: the last bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def check_timings(timings: dict, usage) -> None:
    assert set(timings) == TIMINGS
    assert timings["prompt_n"] + timings["cached_n"] >= usage.prompt_tokens
    assert timings["cached_n"] == timings["cache_n"]
    assert timings["predicted_n"] == usage.completion_tokens
    assert timings["queue_ms"] >= 0 and timings["prompt_ms"] > 0
    if timings["predicted_ms"]:
        assert timings["predicted_per_second"] == pytest.approx(timings["predicted_n"] * 1e3 / timings["predicted_ms"])


async def test_timings_through_the_openai_sdk(sdk):
    prompt = PREFIX + "What is the capital of France?"
    first = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    second = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    for c in (first, second):
        check_timings(c.model_extra["timings"], c.usage)
        assert c.model_extra["timings"]["prompt_n"] + c.model_extra["timings"]["cached_n"] == c.usage.prompt_tokens
        assert c.model_extra["timings"]["cached_n"] == c.usage.prompt_tokens_details.cached_tokens
    assert second.model_extra["timings"]["cached_n"] >= 64 and first.choices[0].text == second.choices[0].text

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = await sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    check_timings(chat.model_extra["timings"], chat.usage)
    assert chat.choices[0].message.content

    stream = await sdk.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert all("timings" not in c.model_extra for c in chunks[:-1])
    check_timings(chunks[-1].model_extra["timings"], chunks[-1].usage)

    # two prompts, two samples each: the request's timings cover all four sequences
    many = await sdk.completions.create(
        model=MODEL,
        prompt=["One, two,", "Red, green,"],
        n=2,
        max_tokens=4,
        temperature=1.0,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    check_timings(many.model_extra["timings"], many.usage)
    assert many.model_extra["timings"]["predicted_n"] == 16
    stream = await sdk.completions.create(
        model=MODEL,
        prompt="One, two,",
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    check_timings(chunks[-1].model_extra["timings"], chunks[-1].usage)


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        pytest.skip(
            "Chromium and chromedriver are not installed (`make test` installs Debian's chromium and "
            "chromium-driver where it runs as root with apt)"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1440,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    yield driver
    driver.quit()


PAGE_STATE = """
const d = window.dashboard, e = d.payload && d.payload.engine;
return e && {events: d.events, running: document.querySelector('#stat-running').textContent,
             rows: [...document.querySelectorAll('#requests tbody tr')]
                   .map(tr => [tr.cells[0].title, tr.dataset.state]),
             drawn: d.drawn, counts: d.kv.counts};
"""


async def test_dashboard_in_a_real_browser(dash, sdk, browser, tmp_path):
    async def page(wait_for, timeout: float = 120):
        deadline = time.monotonic() + timeout
        while True:
            state = await asyncio.to_thread(browser.execute_script, PAGE_STATE)
            if state and wait_for(state):
                return state
            assert time.monotonic() < deadline, f"page state: {state}"
            await asyncio.sleep(0.2)

    await asyncio.to_thread(browser.get, f"{dash.url}/dashboard#key={KEY}")
    await page(lambda s: s["running"] == "0" and not s["rows"] and s["drawn"]["used"] == 0)
    assert "key=" not in browser.current_url  # the page moved the key out of the address bar

    async def one(i: int) -> str:
        stream = await sdk.completions.create(
            model=MODEL,
            prompt=PREFIX + f"Question {i}: what is {i} plus {i}?",
            max_tokens=48,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        ids = {chunk.id async for chunk in stream}
        return ids.pop()

    load = asyncio.gather(*(one(i) for i in range(16)))
    seen_rows, peak = {}, None
    while not load.done():
        state = await page(lambda s: True)
        seen_rows.update(state["rows"])
        if int(state["running"]) >= 12 and state["drawn"]["shared"] and peak is None:
            peak = state
            await asyncio.to_thread(browser.save_screenshot, str(tmp_path / "dashboard.png"))
        await asyncio.sleep(0.2)
    ids = await load
    assert peak is not None, "never saw 12+ running requests with shared KV cells"
    assert peak["counts"]["shared"] >= 4 and peak["drawn"]["used"] > 0  # the prefix's blocks, held by all
    assert {f"{i}-0" for i in ids} <= set(seen_rows)  # every request had its row
    assert {"prefilling", "decoding"} & set(seen_rows.values())
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000

    # back to idle: nothing running, the finished rows faded out, no block in use
    idle = await page(
        lambda s: s["running"] == "0" and not s["rows"] and s["drawn"]["used"] == s["drawn"]["shared"] == 0
    )
    assert idle["drawn"]["cached"] > 0  # the finished requests' blocks stay in the prefix cache
    logs = await asyncio.to_thread(browser.get_log, "browser")
    assert not [entry for entry in logs if entry["level"] == "SEVERE"], logs
