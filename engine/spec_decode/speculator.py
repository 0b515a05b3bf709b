"""The worker's side of speculative decoding: after sampling, booking each verification and drafting the
next step's tokens."""

import logging

from engine.config import EngineConfig
from engine.config.speculative import SpeculativeConfig
from engine.core.step_io import SchedulerOutput
from engine.sample.rejection_sampler import WithDrafts
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.policy import BREAK_EVEN_BATCH, DraftLengthPolicy

logger = logging.getLogger(__name__)


class Speculator:
    """Drafts flow through the ordinary paths (vLLM v1's design):

    1. at the end of step t the first rank's runner calls `propose`, which drafts for the requests that
       sampled, and returns the drafts in its ModelRunnerOutput; the scheduler makes them the requests'
       `spec_token_ids` (`Scheduler.update_from_output`);
    2. step t + 1 schedules each of them 1 + len(drafts) tokens under the token budget (drafts that do
       not fit are dropped) and allocates KV slots for them; the runner computes logits at every position
       of such rows and the RejectionSampler returns the accepted drafts plus one token;
    3. the scheduler rolls `num_computed_tokens` back by the rejected count (their slots are overwritten
       later) and appends the tokens one by one with the usual stop checks, so a request stops exactly where
       it would without drafts; the next `propose` books the outcome for the draft-length policy.

    draft: the draft model's ModelRunner (method draft_model), whose KV cache has the target's blocks and
    is addressed by the target's block tables. Requests with structured outputs are not drafted: verifying
    their drafts would need the grammar's mask at every draft position.
    """

    def __init__(
        self, config: SpeculativeConfig, engine_config: EngineConfig, max_model_len: int, device_type: str, draft=None
    ):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = min(config.max_model_len or max_model_len, max_model_len)
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            self.proposer = DraftModelProposer(draft, engine_config.max_num_batched_tokens)
        self.policy = DraftLengthPolicy(self.k, BREAK_EVEN_BATCH.get(device_type, BREAK_EVEN_BATCH["cuda"]))
        logger.info("speculative decoding: %s, up to %d tokens per step", _describe(config), self.k)

    def init_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """The target's KV cache has `num_blocks` blocks and holds `max_model_len` tokens a sequence."""
        self.proposer.init_kv_cache(num_blocks)
        self.max_model_len = min(self.max_model_len, max_model_len, self.proposer.max_model_len or max_model_len)

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Forgets finished requests; a resumed one's draft K/V is gone with its blocks."""
        for req_id in scheduler_output.finished_req_ids:
            self.proposer.free(req_id)
            self.policy.free(req_id)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, resumed in zip(cached.req_ids, cached.resumed_from_preemption):
            if resumed:
                self.proposer.free(req_id)

    def propose(self, requests: list, sampled_token_ids: list[list[int]], num_running: int) -> dict[str, list[int]]:
        """Books the verification of the drafts each of `requests` (engine.worker.input_batch states that
        sampled this step) checked, then drafts for them: {request id: draft tokens}, their distributions q
        kept in each state's `spec_token_probs` (None for one-hot) for the verification. `num_running`: the
        requests of the step. Drafts never reach past max_tokens or max_model_len, nor follow a token that
        ends its request."""
        for r, new_tokens in zip(requests, sampled_token_ids):
            self.policy.observe(r.req_id, r.spec_token_ids, new_tokens)
        views = [v for v in map(WithDrafts, requests, sampled_token_ids) if not _ends(v)]
        k = self.config.tokens_for_batch(num_running)
        if not views or k == 0:
            return {}
        caps = [0 if r.params.structured_outputs is not None else min(k, self._cap(r)) for r in views]
        lengths = self.policy.lengths(views, caps, num_running)
        # a cheap proposer also proposes (one token) where nothing is sent, to score it next step
        asked = [max(n, min(cap, 1)) if self.proposer.cheap else n for n, cap in zip(lengths, caps)]
        out = {}
        for r, n, (drafts, probs) in zip(views, lengths, self.proposer.propose(views, asked)):
            if n == 0:
                self.policy.keep_shadow(r.request_id, drafts)
            out[r.request_id] = drafts[:n]
            state = r.request  # the worker's copy, which keeps q for the verification
            state.spec_token_probs = probs[:n] if n and probs is not None else None
        return out

    def _cap(self, request: WithDrafts) -> int:
        """Most drafts that can all be kept: room before max_model_len and max_tokens, after the one token
        every step adds."""
        cap = min(self.k, self.max_model_len - request.num_tokens - 1)
        if request.params.max_tokens is not None:
            cap = min(cap, request.params.max_tokens - len(request.output_token_ids) - 1)
        return max(cap, 0)


def _ends(request: WithDrafts) -> bool:
    """Whether the token just sampled surely ends `request` (EOS or a stop token past min_tokens): such a
    request gets no drafts."""
    if len(request.output_token_ids) < request.params.min_tokens:
        return False
    last = request.all_token_ids[-1]
    return last in request.eos_token_ids or last in request.params.stop_token_ids


def _describe(config: SpeculativeConfig) -> str:
    if config.method == "ngram":
        return f"ngram, prompt lookup {config.prompt_lookup_min}..{config.prompt_lookup_max}"
    return f"draft_model {config.model}"


class NoSpeculation:
    """The runner's speculation hooks when speculative decoding is off (and on ranks other than the first):
    nothing is drafted."""

    def init_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        pass

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def propose(self, requests: list, sampled_token_ids: list[list[int]], num_running: int) -> dict[str, list[int]]:
        return {}
