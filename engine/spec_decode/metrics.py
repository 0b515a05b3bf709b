"""Speculative-decoding counters and their log line, as vLLM's vllm/v1/spec_decode/metrics.py."""
import logging
import time
from dataclasses import dataclass, field, replace

logger = logging.getLogger(__name__)


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


class SpecDecodingLogging:
    """Logs vLLM's "SpecDecoding metrics: ..." line for each interval (seconds) that had drafts."""

    def __init__(self, stats: SpecDecodingStats, interval: float = 10.0):
        self.stats, self.interval = stats, interval
        self.last, self.last_time = stats.copy(), time.monotonic()

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self.last_time < self.interval:
            return
        s, last, dt = self.stats, self.last, now - self.last_time
        drafts = s.num_drafts - last.num_drafts
        if drafts:
            drafted = s.num_draft_tokens - last.num_draft_tokens
            accepted = s.num_accepted_tokens - last.num_accepted_tokens
            per_pos = [(a - b) / drafts for a, b in zip(s.num_accepted_tokens_per_pos, last.num_accepted_tokens_per_pos)]
            logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
                        "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
                        "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                        1 + accepted / drafts, accepted / dt, drafted / dt, accepted, drafted,
                        ", ".join(f"{r:.3f}" for r in per_pos), 100 * accepted / max(drafted, 1))
        self.last, self.last_time = s.copy(), now
