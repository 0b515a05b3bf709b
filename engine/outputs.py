"""What the engine hands back: per-request outputs (vLLM's shapes), and engine-wide statistics."""
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probabilities at one generated position, from the model's raw logits (before penalties,
    temperature and top-k/p, as vLLM v1 reports them).

    token_id: the sampled (or, for prompt logprobs, the given) token; logprob: its natural-log
    probability; top_logprobs: the `SamplingParams.logprobs` (or `prompt_logprobs`) most likely
    (token id, logprob) pairs, best first; rank: the token's rank in the distribution (1 = most
    likely), set for prompt logprobs, which report it as vLLM does.
    """

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass
class CompletionOutput:
    """One of the n samples of a request; every field is cumulative since the request started.

    finish_reason: None while running, then "stop" (EOS, stop token or stop string), "length"
    (max_tokens or max_model_len) or "abort". stop_reason: the matched stop string or stop token id,
    None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[Logprob] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times of one request's life, in seconds (`time.monotonic()`)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    `outputs` holds the samples that changed in this step when streaming (`AsyncEngine.generate`),
    and all n samples, ordered by index, in `LLM.generate`'s results. `num_cached_tokens` is how
    many prompt tokens came from the prefix cache. `prompt_logprobs` (with
    `SamplingParams.prompt_logprobs`): one entry per prompt token, None for the first, once the whole
    prompt has been computed; None otherwise.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass
class EngineStats:
    """Counters and gauges for /metrics. Token counts are in tokens, usage is a fraction in [0, 1]."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    prompt_tokens: int  # prompt tokens of requests that started
    generation_tokens: int  # tokens sampled
