"""The engine's side of speculative decoding: proposing after each step, booking each verification."""
import logging

from engine.config.speculative import SpeculativeConfig
from engine.core.step_io import ModelRunnerOutput, SchedulerOutput
from engine.outputs import SpecDecodingStats
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.metrics import SpecDecodingLogging
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.policy import BREAK_EVEN_BATCH, DraftLengthPolicy

logger = logging.getLogger(__name__)


class Speculator:
    """Drafts flow through the ordinary paths (vLLM v1's design):

    1. after step t's update, `propose` returns drafts for the requests that sampled and go on, and
       the scheduler sets them as their `spec_token_ids` (`Scheduler.update_draft_token_ids`);
    2. step t + 1 schedules each of them 1 + len(drafts) tokens under the token budget (drafts that
       do not fit are dropped) and allocates KV slots for them; the runner computes logits at every
       position of such rows and the RejectionSampler returns the accepted drafts plus one token;
    3. `Scheduler.update_from_output` rolls `num_computed_tokens` back by the rejected count (their
       slots are overwritten later) and appends the tokens one by one with the usual stop checks, so
       a request stops exactly where it would without drafts; the next `propose` books the outcome.

    Requests with structured outputs are not drafted: verifying their drafts would need the
    grammar's mask at every draft position.
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

    def propose(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                num_running: int) -> dict[str, tuple[list[int], object]]:
        """After a step's update: books the verification of the drafts the step checked, then drafts
        for the requests that sampled and go on, as {request id: (draft tokens, q [n, vocab] or None)}
        for `Scheduler.update_draft_token_ids`. `num_running`: the running requests. Drafts never reach
        past max_tokens or max_model_len."""
        self.logging.maybe_log()
        verified = scheduler_output.scheduled_spec_decode_tokens
        for req_id, new_tokens in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            drafts = verified.get(req_id, [])
            if drafts:
                self.stats.observe_draft(len(drafts), len(new_tokens) - 1)
            self.policy.observe(req_id, drafts, new_tokens)
        by_id = {r.request_id: r for r in scheduler_output.requests}
        requests = [r for r in (by_id[i] for i in runner_output.req_ids) if not r.is_finished]
        k = self.config.tokens_for_batch(num_running)
        if not requests or k == 0:
            return {}
        # No drafts under structured outputs: verifying them would need the grammar's mask at every
        # draft position (advance the matcher over the drafts, fill, roll back), which is not built.
        caps = [0 if r.grammar is not None else min(k, self._cap(r)) for r in requests]
        lengths = self.policy.lengths(requests, caps, num_running)
        # a cheap proposer also proposes (one token) where nothing is sent, to score it next step
        asked = [max(n, min(cap, 1)) if self.proposer.cheap else n for n, cap in zip(lengths, caps)]
        out = {}
        for r, n, (drafts, probs) in zip(requests, lengths, self.proposer.propose(requests, asked)):
            if n == 0:
                self.policy.keep_shadow(r.request_id, drafts)
            out[r.request_id] = (drafts[:n], probs if n else None)
        return out

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
        self.policy.free(request.request_id)


def _describe(config: SpeculativeConfig) -> str:
    if config.method == "ngram":
        return f"ngram, prompt lookup {config.prompt_lookup_min}..{config.prompt_lookup_max}"
    return f"draft_model {config.model}"


class NoSpeculation:
    """The speculator's hooks when speculative decoding is off: nothing is drafted."""

    stats = None

    def propose(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                num_running: int) -> dict[str, tuple[list[int], object]]:
        return {}

    def free(self, request) -> None:
        pass
