"""How many tokens to draft per request: only as many as verification is expected to pay for."""

from dataclasses import dataclass, field

# Batch at which a decode step's per-token cost equals its fixed cost (one read of the weights). On
# the 2-core EPYC with SmolLM2-135M in bfloat16 a decode step takes ~30 ms at batch 1 and ~106 ms at
# batch 64 (docs/benchmarks.md): ~1.2 ms per token on top of ~29 ms, so ~24. GPUs, whose FLOP/s per
# byte/s of memory is much higher, balance at a few hundred tokens.
BREAK_EVEN_BATCH = {"cpu": 24, "cuda": 256}
DECAY = 0.8  # weight of an older outcome per newer one: the last ~5 positions dominate the estimate
PRIOR_HITS, PRIOR_TRIALS = 1.0, 2.0  # an unseen request is assumed to accept half its draft tokens


@dataclass
class _Acceptance:
    """Decayed counts of one request's verified draft positions: accepted (hits) of evaluated."""

    hits: float = 0.0
    trials: float = 0.0
    shadow: list[int] = field(default_factory=list)  # a proposal made but not sent, scored next step

    def add(self, hit: bool) -> None:
        self.hits = DECAY * self.hits + hit
        self.trials = DECAY * self.trials + 1

    @property
    def rate(self) -> float:
        return (self.hits + PRIOR_HITS) / (self.trials + PRIOR_TRIALS)


class DraftLengthPolicy:
    """Each request's draft length for the next step, from its acceptance rate and the batch size.

    Cost model: a step over T tokens takes about a + b*T (a: one read of the weights, b: compute per
    token). With B requests decoding, a step yields B tokens in a + b*B; one more draft token costs
    b and brings a token with probability alpha^j at draft position j (alpha: the request's recent
    per-position acceptance rate). It pays while alpha^j > b*B / (a + b*B) = B / (B + B0), with B0 =
    a/b (BREAK_EVEN_BATCH). At batch 1 on a CPU nearly any draft pays; at batch 64 only requests
    whose recent drafts were nearly all accepted draft, and only a few tokens. The decision uses
    counts only (no timing), so a run is reproducible.

    alpha: decayed counts of accepted and rejected draft positions with a prior of 1/2. A proposer
    that is cheap (n-gram) proposes for every request; a proposal it does not send is scored against
    the token the request then samples, so requests learn their rate while not drafting.
    """

    def __init__(self, num_speculative_tokens: int, break_even_batch: int):
        self.k, self.break_even_batch = num_speculative_tokens, break_even_batch
        self.requests: dict[str, _Acceptance] = {}

    def lengths(self, requests: list, caps: list[int], num_running: int) -> list[int]:
        """Draft lengths (0..min(k, cap)) for `requests` when `num_running` requests will run."""
        threshold = num_running / (num_running + self.break_even_batch)
        out = []
        for r, cap in zip(requests, caps):
            rate = self.requests.setdefault(r.request_id, _Acceptance()).rate
            n, p = 0, rate
            while n < min(self.k, cap) and p >= threshold:
                n, p = n + 1, p * rate
            out.append(n)
        return out

    def observe(self, request_id: str, drafts: list[int], new_token_ids: list[int]) -> None:
        """Books a step's outcome: the drafts verified (first len(new_token_ids) - 1 accepted), or,
        without drafts, the shadow proposal against the sampled token."""
        state = self.requests.setdefault(request_id, _Acceptance())
        if drafts:
            accepted = len(new_token_ids) - 1
            for _ in range(accepted):
                state.add(True)
            if accepted < len(drafts):
                state.add(False)
        elif state.shadow:
            state.add(new_token_ids[0] == state.shadow[0])
        state.shadow = []

    def keep_shadow(self, request_id: str, proposal: list[int]) -> None:
        self.requests.setdefault(request_id, _Acceptance()).shadow = proposal

    def free(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
