"""The speculative-decoding log line, as vLLM's vllm/v1/spec_decode/metrics.py (the counters are
`engine.outputs.SpecDecodingStats`)."""

import logging
import time

from engine.outputs import SpecDecodingStats

logger = logging.getLogger(__name__)


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
            per_pos = [
                (a - b) / drafts for a, b in zip(s.num_accepted_tokens_per_pos, last.num_accepted_tokens_per_pos)
            ]
            logger.info(
                "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
                "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
                "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                1 + accepted / drafts,
                accepted / dt,
                drafted / dt,
                accepted,
                drafted,
                ", ".join(f"{r:.3f}" for r in per_pos),
                100 * accepted / max(drafted, 1),
            )
        self.last, self.last_time = s.copy(), now
