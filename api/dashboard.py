"""GET /dashboard: a live page of the scheduler and the paged KV cache; GET /dashboard/events: its feed.

The page (api/static/: HTML, CSS and one vanilla JS file) needs no key to load: it holds no data.
The feed is behind --api-key like the API. Browsers' EventSource cannot send an Authorization
header, so the page reads the Server-Sent Events with fetch() streaming, which can (the key is
typed into the page, or given as `/dashboard#key=KEY`, and kept in the tab's sessionStorage).

Each event is one JSON payload: `engine`, the engine's latest snapshot (engine/snapshot.py), and
`metrics`, rolling rates and latency percentiles computed from the server's own Prometheus registry
the way a Grafana panel over /metrics computes them (rate() over 10 s, histogram_quantile() over 60 s),
so the page shows the same numbers /metrics exports under vLLM's names.
"""

import asyncio
import time
from collections import deque
from pathlib import Path

import orjson
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
STATIC_PREFIX = "/dashboard/static/"
POLL_S = 0.2  # a stream sends at most one event per poll: <= 5 per second
REFRESH_S = 1.0  # with no new snapshot (an idle engine), the rolling metrics still refresh this often
RATE_WINDOW_S, LATENCY_WINDOW_S = 10.0, 60.0
COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
}
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
}
QUANTILES = (0.5, 0.9, 0.99)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: `buckets` are (upper bound, cumulative count) ascending, the
    last +Inf; linear within the bucket holding rank q * count. None for an empty histogram."""
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower  # beyond the last finite bound: that bound, as Prometheus answers
            return lower + (upper - lower) * (rank - below) / (count - below) if count > below else upper
        lower, below = upper, count
    return lower


class MetricsWindow:
    """Samples of the registry's counters and histogram buckets over the last minute, and what a
    dashboard derives from them: tokens/s over the last 10 s, hit rate and latency percentiles over 60 s."""

    def __init__(self, registry):
        self._registry = registry
        self._samples: deque[tuple[float, dict[str, float], dict[str, list[tuple[float, float]]]]] = deque()

    def _read(self) -> tuple[dict[str, float], dict[str, list[tuple[float, float]]]]:
        values, buckets = {}, {name: [] for name in HISTOGRAMS.values()}
        for family in self._registry.collect():
            for s in family.samples:
                if s.name.endswith("_bucket") and s.name[: -len("_bucket")] in buckets:
                    buckets[s.name[: -len("_bucket")]].append((float(s.labels["le"]), s.value))
                else:
                    values[s.name] = s.value
        return values, buckets

    def _since(self, now: float, seconds: float):
        """The oldest sample no older than `seconds` (the newest is now's)."""
        return next(s for s in self._samples if now - s[0] <= seconds)

    def sample(self, now: float) -> dict:
        """Reads the registry now; returns rates (per second) and percentiles (seconds), None where
        the window holds nothing yet."""
        values, buckets = self._read()
        self._samples.append((now, values, buckets))
        while now - self._samples[0][0] > LATENCY_WINDOW_S:
            self._samples.popleft()
        out = {"window_s": now - self._samples[0][0]}
        t0, v0, _ = self._since(now, RATE_WINDOW_S)
        for key, name in COUNTERS.items():
            out[key] = values.get(name, 0.0)
            if key in ("prompt_tokens", "generation_tokens"):
                out[f"{key}_per_s"] = (values.get(name, 0.0) - v0.get(name, 0.0)) / (now - t0) if now > t0 else None
        _, v_old, b_old = self._samples[0]
        queries = values.get(COUNTERS["prefix_cache_queries"], 0) - v_old.get(COUNTERS["prefix_cache_queries"], 0)
        hits = values.get(COUNTERS["prefix_cache_hits"], 0) - v_old.get(COUNTERS["prefix_cache_hits"], 0)
        out["prefix_cache_hit_rate"] = hits / queries if queries > 0 else None
        for key, name in HISTOGRAMS.items():
            old = dict(b_old.get(name, ()))
            delta = [(le, count - old.get(le, 0.0)) for le, count in buckets[name]]
            out[key] = {f"p{round(q * 100)}": histogram_quantile(q, delta) if delta else None for q in QUANTILES}
        return out


class DashboardFeed:
    """The payload every open dashboard is sent: rebuilt when the engine published a new snapshot
    or REFRESH_S passed, serialized once and shared by all streams."""

    def __init__(self, ctx):
        self._ctx = ctx
        self._window = MetricsWindow(ctx.metrics.registry)
        self._built: tuple[int, float] = (-1, 0.0)  # (snapshot seq, time) of the current payload
        self.payload: str | None = None

    def current(self, slot) -> str | None:
        """The payload for the slot's latest snapshot (None until there is one)."""
        now = time.monotonic()
        seq, built_at = self._built
        if slot.latest is not None and (slot.seq != seq or now - built_at >= REFRESH_S):
            self._built = (slot.seq, now)
            body = {
                "engine": slot.latest,
                "metrics": self._window.sample(now),
                "server": {
                    "served_model_name": self._ctx.settings.model_id,
                    "snapshot_interval_s": slot.interval,
                },
            }
            self.payload = orjson.dumps(body).decode()
        return self.payload


async def page(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "dashboard.html", headers={"Cache-Control": "no-cache"})


async def events(request: Request) -> Response:
    """Server-Sent Events, one `data: {payload}` per new payload, at most one per POLL_S; ends when
    the engine stops. A client that stops reading for 10 s is dropped."""
    engine, feed = request.app.state.serving.engine, request.app.state.dashboard

    async def stream():
        with engine.watch() as slot:
            last = None
            while engine.is_alive:
                payload = feed.current(slot)
                if payload is not last:
                    last = payload
                    yield payload
                await asyncio.sleep(POLL_S)

    # On shutdown the engine stops first, which ends the stream within POLL_S; the grace period lets
    # that happen before sse-starlette cancels it.
    return EventSourceResponse(
        stream(), sep="\n", ping=15, send_timeout=10, shutdown_grace_period=2, headers={"Cache-Control": "no-store"}
    )


def dashboard_routes() -> list:
    """The routes to add to the app; `build_app` also sets `app.state.dashboard = DashboardFeed(ctx)`."""
    return [
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/events", events, methods=["GET"]),
        Mount(STATIC_PREFIX.rstrip("/"), StaticFiles(directory=STATIC_DIR)),
    ]
