"""The engine's side of speculative decoding: proposing after each step, booking each verification."""
import logging

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.metrics import SpecDecodingLogging, SpecDecodingStats
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.policy import BREAK_EVEN_BATCH, DraftLengthPolicy

logger = logging.getLogger(__name__)


class Speculator:
    """Drafts flow through the ordinary paths (vLLM v1's design):

    1. after step t, `propose` sets `spec_token_ids` on the requests that sampled and go on;
    2. step t + 1 schedules each of them 1 + len(drafts) tokens under the token budget (drafts that
       do not fit are dropped) and allocates KV slots for them; the runner computes logits at every
       position of such rows and the RejectionSampler returns the accepted drafts plus one token;
    3. the engine rolls `num_computed_tokens` back by the rejected count (their slots are
       overwritten later), calls `observe`, and appends the tokens one by one with the usual stop
       checks, so a request stops exactly where it would without drafts.

    Structured outputs plug in at two places: `propose` (truncate drafts at the first token the
    grammar rejects, vLLM's `grammar.validate_tokens`) and the verification (one grammar bitmask per
    draft position; the matcher advanced through the drafts is rolled back to the accepted ones).
    """

    def __init__(self, config: SpeculativeConfig, engine_config, target_runner, tokenizer, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = min(config.max_model_len or max_model_len, max_model_len)
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            self.proposer = DraftModelProposer(config.model, engine_config, target_runner, tokenizer, self.max_model_len)
            self.max_model_len = min(self.max_model_len, self.proposer.max_model_len)
        self.policy = DraftLengthPolicy(self.k, BREAK_EVEN_BATCH.get(target_runner.device.type, BREAK_EVEN_BATCH["cuda"]))
        self.stats = SpecDecodingStats(self.k)
        self.logging = SpecDecodingLogging(self.stats)
        logger.info("speculative decoding: %s, up to %d tokens per step", _describe(config), self.k)

    def observe(self, request, new_token_ids: list[int]) -> None:
        """Books the verification of `request`'s drafts (new_token_ids: accepted drafts + one
        token) and clears them."""
        drafts = request.spec_token_ids
        if drafts:
            self.stats.observe_draft(len(drafts), len(new_token_ids) - 1)
        self.policy.observe(request, drafts, new_token_ids)
        request.spec_token_ids, request.spec_token_probs = [], None

    def propose(self, requests: list, num_running: int) -> None:
        """Sets drafts on `requests` (running, just sampled) for the next step; `num_running` is the
        number of running requests. Drafts never reach past max_tokens or max_model_len."""
        self.logging.maybe_log()
        k = self.config.tokens_for_batch(num_running)
        if not requests or k == 0:
            return
        # No drafts under structured outputs: verifying them would need the grammar's mask at every
        # draft position (advance the matcher over the drafts, fill, roll back), which is not built.
        caps = [0 if r.grammar is not None else min(k, self._cap(r)) for r in requests]
        lengths = self.policy.lengths(requests, caps, num_running)
        # a cheap proposer also proposes (one token) where nothing is sent, to score it next step
        asked = [max(n, min(cap, 1)) if self.proposer.cheap else n for n, cap in zip(lengths, caps)]
        for r, n, (drafts, probs) in zip(requests, lengths, self.proposer.propose(requests, asked)):
            if n == 0:
                self.policy.keep_shadow(r, drafts)
            r.spec_token_ids = drafts[:n]
            r.spec_token_probs = probs if n else None

    def _cap(self, request) -> int:
        """Most drafts that can all be kept: room before max_model_len and max_tokens, after the
        one token every step adds."""
        cap = min(self.k, self.max_model_len - request.num_tokens - 1)
        if request.params.max_tokens is not None:
            cap = min(cap, request.params.max_tokens - len(request.output_token_ids) - 1)
        return max(cap, 0)

    def free(self, request) -> None:
        """Forgets a request whose target blocks were freed (finished, aborted or preempted)."""
        self.proposer.free(request)
        self.policy.free(request)
        request.spec_token_ids, request.spec_token_probs = [], None


def _describe(config: SpeculativeConfig) -> str:
    if config.method == "ngram":
        return f"ngram, prompt lookup {config.prompt_lookup_min}..{config.prompt_lookup_max}"
    return f"draft_model {config.model}"
