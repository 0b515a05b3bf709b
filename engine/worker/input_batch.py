"""The worker's own copy of every request it runs (vLLM v1's InputBatch and CachedRequestState), kept up to
date from each step's SchedulerOutput, and a step's flat model inputs built from it: token ids, positions,
the attention metadata (slot mapping, block tables, sequence lengths) and which rows give logits."""

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.core.step_io import NewRequestData, SchedulerOutput
from engine.sample.prompt_logprobs import PromptRows, select_rows
from engine.sampling_params import SamplingParams
from engine.worker.pooler import PoolingRows
from models.attention.base import AttentionMetadata
from models.layers.short_conv import StateMetadata


@dataclass(eq=False)
class CachedRequestState:
    """One request as a worker knows it: what its inputs and its sampling need.

    token_ids: prompt + the output tokens the scheduler has sent; block_ids: its KV blocks in order, a list
    per KV cache group;
    num_computed_tokens: tokens with K/V before the current step; generator: its own torch.Generator when
    seeded; spec_token_ids: the draft tokens it verifies this step, spec_token_probs their draft
    distributions q [len, vocab] (None: one-hot, as n-gram drafts); num_prompt_logprobs: prompt-logprob
    entries collected (the first prompt token's None included; None when not asked for); pooled: an
    embedding request's pooled state so far (engine.worker.pooler).
    """

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    pooling: str | None = None
    token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    spec_token_probs: torch.Tensor | None = None
    num_prompt_logprobs: int | None = None
    pooled: torch.Tensor | None = None

    @classmethod
    def from_new(cls, new: NewRequestData) -> "CachedRequestState":
        p = new.sampling_params
        return cls(
            new.req_id,
            new.prompt_token_ids,
            p,
            new.eos_token_ids,
            tuple(list(ids) for ids in new.block_ids),
            new.num_computed_tokens,
            new.pooling,
            token_ids=list(new.prompt_token_ids),
            generator=torch.Generator().manual_seed(p.seed) if p.seed is not None else None,
            num_prompt_logprobs=1 if p.prompt_logprobs is not None else None,
        )

    @property
    def request_id(self) -> str:
        return self.req_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class ModelInputs:
    """What the forward pass of one step reads.

    input_ids, positions: int64 [T]; attn_metadata: where each token reads and writes the paged KV cache, one
    per KV cache group (they differ in block tables and slot mapping only; a StateMetadata for the group of
    recurrent layers);
    logits_indices: int64 [N], the rows whose hidden states become logits.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: tuple[AttentionMetadata | StateMetadata, ...]
    logits_indices: torch.Tensor


@dataclass
class StepBatch:
    """One step's model inputs, and which requests' rows are what.

    sampled: the requests that sample this step, in logits order (one has 1 + len(its drafts) logits rows);
    prompt_rows: hidden-state rows that give prompt logprobs; pooling_rows: those of embedding requests.
    """

    model_inputs: ModelInputs
    sampled: list[CachedRequestState]
    prompt_rows: list[PromptRows]
    pooling_rows: list[PoolingRows]


class InputBatch:
    """The requests a worker has been sent and not told are finished (`requests`, by id).

    `update_states` applies one SchedulerOutput (finished ones dropped, new ones added, the others given
    their new tokens, blocks, computed count and drafts); `prepare` builds the step's inputs from them.
    Every rank keeps its own, so every rank builds the same inputs from the same SchedulerOutput.
    """

    def __init__(self):
        self.requests: dict[str, CachedRequestState] = {}

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState.from_new(new)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.token_ids.extend(cached.new_token_ids[i])
            if cached.resumed_from_preemption[i]:  # its K/V is computed again from its prefix-cache hit
                state.block_ids, state.pooled = tuple(list(ids) for ids in cached.new_block_ids[i]), None
            else:
                for table, ids in zip(state.block_ids, cached.new_block_ids[i]):
                    table.extend(ids)
            state.num_computed_tokens = cached.num_computed_tokens[i]
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            state = self.requests[req_id]
            state.spec_token_ids = drafts.get(req_id, [])
            if state.spec_token_probs is not None:  # the drafter's q for the drafts that were kept
                state.spec_token_probs = (
                    state.spec_token_probs[: len(state.spec_token_ids)] if state.spec_token_ids else None
                )

    def prepare(
        self, scheduler_output: SchedulerOutput, block_size: int, device: torch.device, state_group: int | None = None
    ) -> StepBatch:
        """The step's flat inputs. Rows with one new token (decodes) go first, as the attention backends want.
        A request samples when its new tokens reach its last token (unless it is prompt-only, max_tokens 0);
        a row that goes on past it into d draft tokens gets logits at its last 1 + d positions. `state_group`:
        the KV cache group whose table holds each request's state slot (recurrent layers), if any."""
        counts = scheduler_output.num_scheduled_tokens
        reqs = sorted((self.requests[i] for i in counts), key=lambda r: counts[r.req_id] != 1)
        starts = [r.num_computed_tokens for r in reqs]
        ends = [r.num_computed_tokens + counts[r.req_id] for r in reqs]
        num_drafts = [e - r.num_tokens for r, e in zip(reqs, ends)]  # -k: still prefilling
        sampled = [i for i, (r, d) in enumerate(zip(reqs, num_drafts)) if d >= 0 and r.params.max_tokens != 0]
        num_logits = [0] * len(reqs)
        for i in sampled:
            num_logits[i] = num_drafts[i] + 1
        inputs, qsl = build_model_inputs(
            [_new_token_ids(r, s, e) for r, s, e in zip(reqs, starts, ends)],
            starts,
            [r.block_ids for r in reqs],
            num_logits,
            block_size,
            device,
            state_group,
        )
        pooling = [
            PoolingRows(r.req_id, int(qsl[i]), e - s, e == r.num_tokens)
            for i, (r, s, e) in enumerate(zip(reqs, starts, ends))
            if r.pooling
        ]
        return StepBatch(
            inputs,
            [reqs[i] for i in sampled],
            select_rows(reqs, starts, [e - s for s, e in zip(starts, ends)], qsl),
            pooling,
        )


def build_model_inputs(
    token_ids: list[list[int]],
    starts: list[int],
    block_tables: list[tuple[list[int], ...]],
    num_logits: list[int],
    block_size: int,
    device: torch.device,
    state_group: int | None = None,
) -> tuple[ModelInputs, np.ndarray]:
    """Flat inputs of rows laid end to end: row i computes `token_ids[i]` at positions starts[i].. with the
    KV blocks `block_tables[i]` (a list per KV cache group: one attention metadata per group; for
    `state_group`, the recurrent layers', its state slot and a StateMetadata), and gives logits at its last
    `num_logits[i]` positions (0: none). Rows with one token must come first (the attention metadata's
    decodes). Returns the inputs and the rows' start offsets in the flat batch (query_start_loc, int64
    [rows + 1])."""
    n = len(token_ids)
    starts = np.asarray(starts, dtype=np.int64)
    # a decode step (a token and its logits a row, the common step) skips the general case's index arithmetic:
    # with the caches cold from the layers' weights each small numpy op costs microseconds
    decode = all(len(ids) == 1 for ids in token_ids) and all(w == 1 for w in num_logits)
    if decode:
        counts, qsl = np.ones(n, dtype=np.int64), np.arange(n + 1, dtype=np.int64)
        row_of_token, positions = qsl[:-1], starts
        input_ids = np.fromiter((ids[0] for ids in token_ids), np.int64, n)
    else:
        counts = np.fromiter(map(len, token_ids), np.int64, n)
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        # position of every token: its row's start + its rank inside the row
        row_of_token = np.repeat(np.arange(n), counts)
        positions = starts[row_of_token] + np.arange(qsl[-1]) - qsl[row_of_token]
        input_ids = np.fromiter((t for ids in token_ids for t in ids), np.int64, int(qsl[-1]))
    seq_lens = starts + counts
    query_start_loc = torch.from_numpy(qsl.astype(np.int32)).to(device)
    seq_lens_t = torch.from_numpy(seq_lens.astype(np.int32)).to(device)
    num_decodes = n if decode else int((counts == 1).sum())
    qsl_cpu, seq_lens_cpu = qsl.tolist(), seq_lens.tolist()
    metas = []
    for g in range(len(block_tables[0])):
        if g == state_group:
            slots = torch.tensor([t[g][0] for t in block_tables], dtype=torch.int64, device=device)
            metas.append(StateMetadata(qsl_cpu, num_decodes, slots, (starts > 0).tolist()))
            continue
        bt = np.zeros((len(token_ids), max(len(t[g]) for t in block_tables)), dtype=np.int32)
        for i, t in enumerate(block_tables):
            bt[i, : len(t[g])] = t[g]
        slots = bt[row_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
        metas.append(
            AttentionMetadata(
                query_start_loc=query_start_loc,
                seq_lens=seq_lens_t,
                block_tables=torch.from_numpy(bt).to(device),
                slot_mapping=torch.from_numpy(slots).to(device),
                num_decodes=num_decodes,
                query_start_loc_cpu=qsl_cpu,
                seq_lens_cpu=seq_lens_cpu,
            )
        )
    if decode:
        logits_indices = torch.from_numpy(row_of_token).to(device)
    else:  # the last w tokens of each row with logits: row end - w + rank inside those
        widths = np.asarray(num_logits, dtype=np.int64)
        rank = np.arange(widths.sum()) - np.repeat(np.cumsum(widths) - widths, widths)
        logits_indices = torch.from_numpy(np.repeat(qsl[1:] - widths, widths) + rank).to(device)
    return ModelInputs(
        torch.from_numpy(input_ids).to(device), torch.from_numpy(positions).to(device), tuple(metas), logits_indices
    ), qsl


def _new_token_ids(state: CachedRequestState, start: int, end: int) -> list[int]:
    """Token ids at positions [start, end) of a request, its draft tokens after its last token."""
    ids = state.token_ids[start:end]
    if end > state.num_tokens:
        ids = ids + state.spec_token_ids[: end - state.num_tokens]
    return ids
