"""What the engine hands back: per-request outputs (vLLM's shapes), and engine-wide statistics."""

from dataclasses import dataclass, field, replace


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
    """Wall-clock times of one request's life, in seconds (`time.monotonic()`), and its token counts.

    num_cached_tokens: prompt tokens found in the prefix cache when it was first scheduled;
    num_preemptions: times it was preempted (its K/V freed and recomputed later).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0

    @classmethod
    def merge(cls, metrics: list["RequestMetrics"]) -> "RequestMetrics":
        """One set for several sequences (the n samples of a request, the prompts of one API call):
        counts add up, times run from the earliest start to the latest end (finished once all are)."""

        def earliest(values):
            values = [v for v in values if v is not None]
            return min(values) if values else None

        finished = [m.finished_time for m in metrics]
        return cls(
            arrival_time=min(m.arrival_time for m in metrics),
            first_scheduled_time=earliest(m.first_scheduled_time for m in metrics),
            first_token_time=earliest(m.first_token_time for m in metrics),
            last_token_time=max((m.last_token_time for m in metrics if m.last_token_time is not None), default=None),
            finished_time=None if None in finished else max(finished),
            **{
                f: sum(getattr(m, f) for m in metrics)
                for f in ("num_prompt_tokens", "num_cached_tokens", "num_generation_tokens", "num_preemptions")
            },
        )

    def timings(self) -> dict[str, int | float]:
        """llama.cpp server's `timings` object (its field names and definitions; times in ms), plus
        what this engine knows besides: `queue_ms` (arrival to first scheduled), `cached_n` (= llama.cpp's
        `cache_n`: prompt tokens served from the prefix cache) and `preemptions`.

        prompt_n: prompt tokens computed (not from the cache); prompt_ms: first scheduled to first
        token. predicted_n: tokens generated; predicted_ms: first token to last, divided by
        predicted_n as llama.cpp does. Rates of an empty span are 0.
        """

        def span(start, end):
            return (end - start) * 1e3 if start is not None and end is not None else 0.0

        prompt_n = self.num_prompt_tokens - self.num_cached_tokens
        prompt_ms = span(self.first_scheduled_time, self.first_token_time)
        predicted_n = self.num_generation_tokens
        predicted_ms = span(self.first_token_time, self.last_token_time)
        return {
            "queue_ms": span(self.arrival_time, self.first_scheduled_time),
            "cache_n": self.num_cached_tokens,
            "cached_n": self.num_cached_tokens,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n * 1e3 / prompt_ms if prompt_ms else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": predicted_n * 1e3 / predicted_ms if predicted_ms else 0.0,
            "preemptions": self.num_preemptions,
        }


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
    kv_transfer_params: dict | None = None  # for the decode server, when its blocks wait for one (engine.kv_transfer)
    embedding: list[float] | None = None  # an embedding request's, once finished (engine.worker.pooler)


class FinalOutputs:
    """Each request's final RequestOutput, from the outputs a stream gives step by step (which carry
    only the samples that changed): `add` every output; it returns the final one, with all n samples
    ordered by index, when the request finishes (None before)."""

    def __init__(self):
        self._samples: dict[str, dict[int, CompletionOutput]] = {}

    def add(self, out: RequestOutput) -> RequestOutput | None:
        samples = self._samples.setdefault(out.request_id, {})
        samples.update({c.index: c for c in out.outputs})
        if not out.finished:
            return None
        del self._samples[out.request_id]
        out.outputs = [samples[i] for i in sorted(samples)]
        return out


@dataclass
class SpecDecodingStats:
    """Cumulative counts (tokens) since the engine started.

    num_drafts: verified drafts (one per request and step that had draft tokens); num_draft_tokens:
    their tokens; num_accepted_tokens: those accepted; num_accepted_tokens_per_pos[i]: drafts whose
    token at position i was accepted (length num_speculative_tokens). Exported as vLLM's
    `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
    `..._num_accepted_tokens_per_pos` (label `position`).
    """

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.num_accepted_tokens_per_pos = self.num_accepted_tokens_per_pos or [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def copy(self) -> "SpecDecodingStats":
        return replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified draft, the bonus token included: 1 + accepted / drafts (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(frozen=True)
class ModelDetails:
    """What the engine serves, for the APIs that describe a model (Ollama's /api/tags, /api/show, /api/ps).

    architecture: the config's model_type ("llama", "qwen3", ...); file_format: "gguf" or "safetensors";
    num_parameters: weights of the model on the first rank (a quantized matrix as rows x cols); weight_formats:
    resident bytes per format ("Q4_1 (R16)", "bfloat16", ...); kv_cache_bytes: the KV cache's bytes on that rank.
    """

    architecture: str
    file_format: str
    num_parameters: int
    weight_formats: dict[str, int]
    kv_cache_bytes: int

    @property
    def quantization(self) -> str:
        """The format holding most of the weight bytes, as Ollama names it ("Q4_1", "BF16", "F32")."""
        name = max(self.weight_formats, key=self.weight_formats.get) if self.weight_formats else "float32"
        name = name.removesuffix(" (R16)")
        return {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(name, name)


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
    # prompt tokens by where their K/V came from: local_compute, local_cache_hit, external_kv_transfer;
    # and cached ones computed again (a fully cached prompt still computes its last token), as in vLLM
    prompt_tokens_by_source: dict[str, int] = field(default_factory=dict)
    prompt_tokens_recomputed: int = 0
    kv_transfer_failures: int = 0  # KV pulls that failed (decode side)
    kv_expired_requests: int = 0  # pinned requests freed unread after the timeout (prefill side)
    spec_decoding: SpecDecodingStats | None = None  # with speculative decoding: drafts and acceptances
