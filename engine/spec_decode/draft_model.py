"""A draft model proposes: k autoregressive steps of a (smaller) model with the target's vocabulary,
on its own paged KV cache (vLLM's method "draft_model")."""
import dataclasses
import logging

import torch

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.step_io import SchedulerOutput
from engine.sample.rejection_sampler import RejectionSampler, WithDrafts
from engine.worker.model_runner import ModelRunner
from models.loader import load_config, load_tokenizer, resolve_model

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class DraftSequence:
    """The draft model's view of one request, a `engine.core.step_io.Sequence` of its own: its KV
    progress in the draft's cache, and the drafts of its last proposal.

    base: the request's length when `drafts` were proposed; K/V of the draft tokens that the target
    accepted stay valid (same tokens at the same positions), the rest is recomputed.
    """

    request_id: str
    request: object = None
    num_computed_tokens: int = 0
    block_hashes: list = dataclasses.field(default_factory=list)
    all_token_ids: list = dataclasses.field(default_factory=list)
    spec_token_ids: list = dataclasses.field(default_factory=list)  # always empty: rows end at their last token
    base: int = 0
    drafts: list = dataclasses.field(default_factory=list)
    probs: list = dataclasses.field(default_factory=list)
    prompt_logprobs: None = None  # the target collects them, never the draft
    pooling: None = None  # embedding requests sample nothing, so are never drafted

    @property
    def params(self):
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModelProposer:
    """Runs the draft model for the requests given a draft length: first one forward that catches its
    KV up with each request's tokens (chunked to max_num_batched_tokens; a request that does not fit
    gets no draft this step), then one decode forward per further draft token.

    Its KV cache has as many blocks as the target's, with its own block tables, prefix caching off;
    a request's blocks go when the target frees it (finish, abort, preemption). Drafts are sampled
    like target tokens (greedy rows: argmax; random rows: from q, which goes to the verification).

    Raises ValueError at construction when the draft's vocabulary differs from the target's.
    """

    cheap = False

    def __init__(self, model: str, config: EngineConfig, target_runner, target_tokenizer, max_model_len: int):
        try:
            model_dir = resolve_model(model)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"speculative draft model: {e}") from None
        hf_config = load_config(model_dir)
        tokenizer = load_tokenizer(model_dir)
        if hf_config.vocab_size != target_runner.model.config.vocab_size or tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise ValueError(f"speculative draft model {model!r} does not share the target's tokenizer and "
                             f"vocabulary ({hf_config.vocab_size} vs {target_runner.model.config.vocab_size} "
                             "logits); draft_model needs the same vocabulary")
        draft_config = dataclasses.replace(config, model=model, tokenizer=None, max_model_len=max_model_len,
                                           enforce_eager=True, speculative_config=None)
        self.runner = ModelRunner(draft_config, hf_config, model_dir, target_runner.device)
        self.runner.init_kv_cache(target_runner.num_blocks, cuda_graphs=False)
        self.max_model_len = self.runner.max_model_len
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, enable_caching=False)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.sampler = RejectionSampler()
        self.seqs: dict[str, DraftSequence] = {}
        logger.info("draft model %s: %d KV blocks of its own", model, self.runner.num_blocks)

    def propose(self, requests: list, lengths: list[int]) -> list[tuple[list[int], object]]:
        """Up to lengths[i] draft tokens for requests[i], with their q [n, vocab] (None if greedy)."""
        budget = self.max_num_batched_tokens
        rows, counts = [], []
        for r, length in zip(requests, lengths):
            if length <= 0:
                continue
            seq = self.seqs.setdefault(r.request_id, DraftSequence(r.request_id))
            # K/V is valid up to the last draft token the target accepted
            matched = 0
            while matched < len(seq.drafts) and seq.base + matched < r.num_tokens and \
                    seq.drafts[matched] == r.all_token_ids[seq.base + matched]:
                matched += 1
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.base + matched)
            seq.request, seq.all_token_ids, seq.base, seq.drafts, seq.probs = r, r.all_token_ids, r.num_tokens, [], []
            n = min(r.num_tokens - seq.num_computed_tokens, budget)
            if n > 0 and self.kv.allocate_slots(seq, n):
                rows.append((seq, length))
                counts.append(n)
                budget -= n
        live = dict(rows)
        while rows:
            batch = SchedulerOutput([seq for seq, _ in rows], counts, [self.kv.block_ids(s.request_id) for s, _ in rows])
            logits, sampled = self.runner.compute_logits(batch)
            for seq, n in zip(batch.requests, counts):
                seq.num_computed_tokens += n
            if not sampled:
                break
            tokens, qs = self.sampler.sample_draft(logits, [WithDrafts(s.request, s.drafts) for s in sampled])
            rows, counts = [], []
            for seq, token, q in zip(sampled, tokens, qs):
                seq.drafts.append(token)
                seq.probs.append(q)
                seq.all_token_ids = seq.request.all_token_ids + seq.drafts
                if len(seq.drafts) < live[seq] and self.kv.allocate_slots(seq, 1):
                    rows.append((seq, live[seq]))
                    counts.append(1)
        out = []
        for r, length in zip(requests, lengths):
            seq = self.seqs.get(r.request_id)
            if length <= 0 or seq is None or seq.base != r.num_tokens:
                out.append(([], None))
                continue
            random = seq.probs and seq.probs[0] is not None
            out.append((list(seq.drafts), torch.stack(seq.probs) if random else None))
        return out

    def free(self, request) -> None:
        seq = self.seqs.pop(request.request_id, None)
        if seq is not None:
            self.kv.free(seq)
