"""A draft model proposes: k autoregressive steps of a (smaller) model with the target's vocabulary (vLLM's
method "draft_model"), its KV cache addressed by the target's block tables."""

import dataclasses
import logging

import torch

from engine.sample.rejection_sampler import RejectionSampler, WithDrafts
from models.loader import load_config, load_tokenizer, resolve_model

logger = logging.getLogger(__name__)


def check_draft_model(model: str, target_vocab_size: int, target_tokenizer) -> None:
    """Raises ValueError unless the draft `model` has the target's vocabulary and tokenizer (and
    FileNotFoundError when it cannot be found): a draft token must mean the same to both."""
    try:
        model_dir = resolve_model(model)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"speculative draft model: {e}") from None
    vocab_size = load_config(model_dir).vocab_size
    if vocab_size != target_vocab_size or load_tokenizer(model_dir).get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"speculative draft model {model!r} does not share the target's tokenizer and "
            f"vocabulary ({vocab_size} vs {target_vocab_size} logits); draft_model needs the same "
            f"vocabulary"
        )


@dataclasses.dataclass
class _DraftState:
    """How far the draft's K/V of one request is valid (`num_computed`), and its last proposal: `drafts`
    (with their q, None where greedy) drafted after the request's first `base` tokens. K/V of the drafts the
    target then accepted stays valid (the same tokens at the same positions); the rest is recomputed."""

    num_computed: int = 0
    base: int = 0
    drafts: list = dataclasses.field(default_factory=list)
    probs: list = dataclasses.field(default_factory=list)


class DraftModelProposer:
    """Runs the draft model (`runner`, a ModelRunner on the target's device) for the requests given a draft
    length: first one forward that catches its K/V up with each request's tokens (chunked to
    max_num_batched_tokens; a request that does not fit gets no draft this step), then one decode forward
    per further draft token.

    Its KV cache has as many blocks as the target's and each request writes its draft K/V into the blocks of
    its own target block table (the scheduler allocates the target's lookahead slots for the proposals), so
    there is no second block manager: a request's draft K/V goes with its blocks (finish, preemption).
    Drafts are sampled like target tokens (greedy rows: argmax; random rows: from q, which goes to the
    verification).
    """

    cheap = False

    def __init__(self, runner, max_num_batched_tokens: int):
        if len(runner.kv_cache_groups) > 1:  # it writes its K/V by the target's first block table
            raise ValueError(
                "speculative draft model: a model mixing sliding-window and global layers is not supported"
            )
        self.runner = runner
        self.max_num_batched_tokens = max_num_batched_tokens
        self.sampler = RejectionSampler()
        self.states: dict[str, _DraftState] = {}
        self.max_model_len = runner.max_model_len

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks, cuda_graphs=False)
        self.max_model_len = self.runner.max_model_len
        logger.info("draft model: %d KV blocks, on the target's block tables", num_blocks)

    def propose(self, requests: list[WithDrafts], lengths: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to lengths[i] draft tokens for requests[i] (a worker's request state with the tokens it just
        sampled), with their q [n, vocab] (None if greedy)."""
        block_size = self.runner.block_size
        budget = self.max_num_batched_tokens
        rows = []  # (request, its state, its length, tokens to catch up)
        for r, length in zip(requests, lengths):
            if length <= 0:
                continue
            state = self.states.setdefault(r.request_id, _DraftState())
            matched = 0  # drafts of the last proposal that the target accepted
            while (
                matched < len(state.drafts)
                and state.base + matched < r.num_tokens
                and state.drafts[matched] == r.all_token_ids[state.base + matched]
            ):
                matched += 1
            state.num_computed = min(state.num_computed, state.base + matched)
            state.base, state.drafts, state.probs = r.num_tokens, [], []
            # the proposals' K/V goes to positions num_tokens .. num_tokens + length - 2
            length = min(length, len(r.request.block_ids[0]) * block_size - r.num_tokens + 1)
            n = min(r.num_tokens - state.num_computed, budget)
            if n > 0 and length > 0:
                rows.append((r, state, length, n))
                budget -= n
        while rows:
            rows.sort(key=lambda row: row[3] != 1)  # one-token rows first
            # a row whose tokens reach its last one (or last draft) gives logits: its next draft
            ends = [s.num_computed + n == r.num_tokens + len(s.drafts) for r, s, _, n in rows]
            done = [row for row, end in zip(rows, ends) if end]
            logits = self.runner.compute_logits_of_rows(
                [(r.all_token_ids + s.drafts)[s.num_computed : s.num_computed + n] for r, s, _, n in rows],
                [s.num_computed for _, s, _, _ in rows],
                [r.request.block_ids[0] for r, _, _, _ in rows],
                [int(end) for end in ends],
            )
            for _, s, _, n in rows:
                s.num_computed += n
            if logits is None:
                break
            tokens, qs = self.sampler.sample_draft(logits, [WithDrafts(r, s.drafts) for r, s, _, _ in done])
            rows = []
            for (r, s, length, _), token, q in zip(done, tokens, qs):
                s.drafts.append(token)
                s.probs.append(q)
                if len(s.drafts) < length:
                    rows.append((r, s, length, 1))
        out = []
        for r, length in zip(requests, lengths):
            state = self.states.get(r.request_id)
            if length <= 0 or state is None or state.base != r.num_tokens or not state.drafts:
                out.append(([], None))
                continue
            random = state.probs[0] is not None
            out.append((list(state.drafts), torch.stack(state.probs) if random else None))
        return out

    def free(self, request_id: str) -> None:
        """Forgets a request: finished, or preempted (its blocks, with the draft's K/V, were freed)."""
        self.states.pop(request_id, None)
