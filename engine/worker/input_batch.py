"""A step's flat model inputs, built from the scheduler's output: token ids, positions, the attention
metadata (slot mapping, block tables, sequence lengths) and which rows give logits."""
from dataclasses import dataclass

import numpy as np
import torch

from models.attention.base import AttentionMetadata
from engine.core.step_io import SchedulerOutput, Sequence
from engine.sample.prompt_logprobs import PromptRows, select_rows
from engine.worker.pooler import PoolingRows


@dataclass
class ModelInputs:
    """What the forward pass of one step reads (what tensor-parallel ranks receive from rank 0).

    input_ids, positions: int64 [T]; attn_metadata: where each token reads and writes the paged KV
    cache; logits_indices: int64 [N], the rows whose hidden states become logits.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor


@dataclass
class InputBatch:
    """One step's model inputs and what rank 0 needs to turn its logits into tokens.

    sampled: the sequences that sample this step, in logits order (row i has 1 + len(its drafts)
    logits rows); prompt_rows: hidden-state rows that give prompt logprobs; pooling_rows: those of
    embedding requests.
    """

    model_inputs: ModelInputs
    sampled: list[Sequence]
    prompt_rows: list[PromptRows]
    pooling_rows: list[PoolingRows]


def prepare_inputs(scheduler_output: SchedulerOutput, block_size: int, device: torch.device) -> InputBatch:
    """Builds the step's flat input tensors and attention metadata.

    Rows with one new token (decodes) go first, as the attention backends want. A sequence samples
    when its new tokens reach its last token (unless it is prompt-only, max_tokens 0); a row that goes
    on past it into d draft tokens (`spec_token_ids`) gets logits at its last 1 + d positions, so N >=
    the number of sampled sequences.
    """
    so = scheduler_output
    order = sorted(range(len(so.requests)), key=lambda i: so.num_new_tokens[i] != 1)
    reqs = [so.requests[i] for i in order]
    counts = np.array([so.num_new_tokens[i] for i in order], dtype=np.int64)
    tables = [so.block_tables[i] for i in order]
    starts = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
    seq_lens = starts + counts
    qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
    np.cumsum(counts, out=qsl[1:])
    # position of every token: its row's start + its rank inside the row
    row_of_token = np.repeat(np.arange(len(reqs)), counts)
    positions = starts[row_of_token] + np.arange(qsl[-1]) - qsl[row_of_token]
    input_ids = np.concatenate([_new_token_ids(r, s, e) for r, s, e in zip(reqs, starts, seq_lens)])
    max_blocks = max(len(t) for t in tables)
    bt = np.zeros((len(reqs), max_blocks), dtype=np.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    slots = bt[row_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    num_drafts = seq_lens - np.array([r.num_tokens for r in reqs], dtype=np.int64)  # -k: still prefilling
    sampled = np.flatnonzero((num_drafts >= 0) & np.array([r.params.max_tokens != 0 for r in reqs], dtype=bool))
    meta = AttentionMetadata(
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(bt).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        num_decodes=int((counts == 1).sum()),
        query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist())
    # the last 1 + d tokens of each sampled row: row end - width + rank inside the row
    widths = num_drafts[sampled] + 1
    rank = np.arange(widths.sum()) - np.repeat(np.cumsum(widths) - widths, widths)
    logits_indices = torch.from_numpy(np.repeat(qsl[1:][sampled] - widths, widths) + rank).to(device)
    inputs = ModelInputs(torch.from_numpy(input_ids.astype(np.int64)).to(device), torch.from_numpy(positions).to(device),
                         meta, logits_indices)
    pooling = [PoolingRows(r.request_id, int(qsl[i]), int(counts[i]), bool(seq_lens[i] == r.num_tokens))
               for i, r in enumerate(reqs) if r.pooling]
    return InputBatch(inputs, [reqs[i] for i in sampled], select_rows(reqs, starts, counts, qsl), pooling)


def _new_token_ids(seq: Sequence, start: int, end: int) -> list[int]:
    """Token ids at positions [start, end) of a sequence, its draft tokens after its last token."""
    ids = seq.all_token_ids[start:end]
    if end > seq.num_tokens:
        ids = ids + seq.spec_token_ids[:end - seq.num_tokens]
    return ids
