"""Prometheus metrics under vLLM's names, so dashboards and routers made for vLLM work unchanged.

Engine gauges and counters are read from `engine.stats()` at scrape time; per-request histograms and
`vllm:request_success` are recorded by `RequestTracker` as each request's outputs stream through the
server. Times are in seconds; `vllm:kv_cache_usage_perc` is a fraction in [0, 1], as in vLLM.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine import RequestOutput

# vLLM's bucket boundaries, so histograms line up with vLLM's in the same dashboard.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _EngineCollector(Collector):
    """The engine's own gauges and cumulative counters, read once per scrape."""

    def __init__(self, engine, label_names: list[str], label_values: list[str]):
        self._engine = engine
        self._names, self._labels = label_names, label_values

    def collect(self):
        s = self._engine.stats()
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests running on the engine.", s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", s.kv_cache_usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=self._names)
            gauge.add_metric(self._labels, value)
            yield gauge
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("vllm:num_preemptions", "Preemptions of running requests.", s.num_preemptions),
            ("vllm:prompt_tokens", "Prompt tokens processed.", s.prompt_tokens),
            (
                "vllm:prompt_tokens_recomputed",
                "Cached prompt tokens computed again (the last one).",
                s.prompt_tokens_recomputed,
            ),
            ("vllm:generation_tokens", "Tokens generated.", s.generation_tokens),
            ("vllm:nixl_num_failed_transfers", "KV pulls from a prefill server that failed.", s.kv_transfer_failures),
            (
                "vllm:nixl_num_kv_expired_reqs",
                "Requests whose KV blocks no decode server pulled in time.",
                s.kv_expired_requests,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=self._names)
            counter.add_metric(self._labels, value)
            yield counter
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from.",
            labels=[*self._names, "source"],
        )
        for source, value in s.prompt_tokens_by_source.items():
            by_source.add_metric([*self._labels, source], value)
        yield by_source
        if s.spec_decoding is not None:
            yield from _spec_decoding_metrics(s.spec_decoding, self._names, self._labels)


def _spec_decoding_metrics(spec, names: list[str], labels: list[str]):
    """vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py), `position` 0..k-1."""
    for name, doc, value in (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens),
    ):
        counter = CounterMetricFamily(name, doc, labels=names)
        counter.add_metric(labels, value)
        yield counter
    counter = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Number of accepted tokens per draft position.",
        labels=[*names, "position"],
    )
    for position, value in enumerate(spec.num_accepted_tokens_per_pos):
        counter.add_metric([*labels, str(position)], value)
    yield counter


class ServerMetrics:
    """The registry behind GET /metrics (one per app, so several apps can live in one process).

    Every sample has the label model_name and, for a data-parallel replica (`data_parallel_rank` not
    None), engine="<rank>" as in vLLM, so the scrapes of all replicas add up."""

    def __init__(self, engine, model_name: str, data_parallel_rank: int | None = None):
        self.registry = CollectorRegistry()
        labels, values = ["model_name"], [model_name]
        if data_parallel_rank is not None:
            labels, values = [*labels, "engine"], [*values, str(data_parallel_rank)]
        self.registry.register(_EngineCollector(engine, labels, values))
        reg = self.registry
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels, registry=reg, buckets=_TTFT_BUCKETS
        ).labels(*values)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive tokens.",
            labels,
            registry=reg,
            buckets=_ITL_BUCKETS,
        ).labels(*values)
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Per request: time per output token after the first.",
            labels,
            registry=reg,
            buckets=_ITL_BUCKETS,
        ).labels(*values)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", labels, registry=reg, buckets=_REQUEST_BUCKETS
        ).labels(*values)
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Arrival to first scheduled.",
            labels,
            registry=reg,
            buckets=_REQUEST_BUCKETS,
        ).labels(*values)
        self._success = Counter(
            "vllm:request_success", "Finished samples, by finish reason.", [*labels, "finished_reason"], registry=reg
        )
        self._values = values

    def count_finished(self, finish_reason: str) -> None:
        self._success.labels(*self._values, finish_reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestTracker:
    """Records one engine request's latencies and finish reasons from the outputs it streams."""

    def __init__(self, metrics: ServerMetrics, n: int):
        self._metrics = metrics
        self._n = n
        self._finish_reasons: dict[int, str] = {}
        self._last_token_time: float | None = None

    def observe(self, out: RequestOutput) -> None:
        """Call with each output of the request, in order."""
        for c in out.outputs:
            if c.finish_reason is not None:
                self._finish_reasons[c.index] = c.finish_reason
        m = out.metrics
        if m is None or m.last_token_time is None:
            return
        if self._last_token_time is None:
            self._metrics.ttft.observe(m.first_token_time - m.arrival_time)
        elif m.last_token_time > self._last_token_time:
            self._metrics.itl.observe(m.last_token_time - self._last_token_time)
        self._last_token_time = m.last_token_time
        if out.finished and m.finished_time is not None:
            self._metrics.e2e.observe(m.finished_time - m.arrival_time)
            tokens_per_sample = m.num_generation_tokens / self._n  # the n samples run side by side
            if tokens_per_sample > 1:
                self._metrics.tpot.observe((m.last_token_time - m.first_token_time) / (tokens_per_sample - 1))
            if m.first_scheduled_time is not None:
                self._metrics.queue.observe(m.first_scheduled_time - m.arrival_time)

    def close(self) -> None:
        """Counts each sample's finish reason; samples that never finished (the client left, or the
        engine failed) count as "abort"."""
        for index in range(self._n):
            self._metrics.count_finished(self._finish_reasons.get(index, "abort"))
