"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): the log-probability of every prompt token
given the tokens before it, its rank, and the top-k alternatives, from the prefill's hidden states.

The hidden state at position p predicts token p + 1, so a prefill chunk over positions [s, e) gives the
entries of prompt tokens s + 1 .. e. Each step's rows are reduced at once to (logprob, rank, top-k), in
slices of `SLICE_ROWS` rows, so memory stays at [SLICE_ROWS, vocab] float32 however long the prompt
(never [prompt_len, vocab]). The positions must be computed, not read from the prefix cache, so a
request collecting prompt logprobs skips reading the cache until it has them all (as vLLM does); of
the n samples of a request only the first (index 0) collects them.
"""

from dataclasses import dataclass

import torch

from engine.outputs import Logprob

SLICE_ROWS = 256  # rows of logits held at once: 256 x 49152 float32 (SmolLM2's vocabulary) = 48 MiB


@dataclass
class PromptRows:
    """Rows `row .. row + count - 1` of a step's hidden states, at positions `position ..`, predict
    prompt tokens `position + 1 ..` of `request` (a worker's engine.worker.input_batch.CachedRequestState)."""

    request: object
    row: int
    position: int
    count: int


def select_rows(requests, starts, counts, query_start_loc) -> list[PromptRows]:
    """The rows of one step that give prompt-logprob entries not collected yet, counting them as collected
    (`num_prompt_logprobs` of each request: entries so far, the first prompt token's None included).

    requests: the step's requests in row order; starts / counts / query_start_loc: their computed
    tokens before the step, new tokens, and first rows (sequences of ints, [B], [B], [B + 1]).
    """
    out = []
    for i, state in enumerate(requests):
        have = state.num_prompt_logprobs
        if have is None or have == state.num_prompt_tokens:
            continue
        start, end = int(starts[i]), int(starts[i]) + int(counts[i])
        # entries are collected in order: the next one is for token `have`, predicted at have - 1
        assert start <= have - 1, "prompt logprobs need every prompt position computed, in order"
        first, last = have - 1, min(end, state.num_prompt_tokens - 1)
        if first < last:
            out.append(PromptRows(state, int(query_start_loc[i]) + first - start, first, last - first))
            state.num_prompt_logprobs += last - first
    return out


def collect(model, hidden: torch.Tensor, rows: list[PromptRows]) -> dict[str, list[Logprob]]:
    """The entries the selected positions give, by request id, to append to each request's prompt logprobs
    in order: the prompt token's logprob and rank, and the request's top `params.prompt_logprobs` (token id,
    logprob) pairs. Every tensor-parallel rank calls it (the logits are gathered on the first rank); the
    others get {}.

    model: has `compute_logits(hidden [N, H]) -> float32 [N, vocab]` (None on the other ranks); hidden: the
    step's hidden states [T, H]. Logprobs come from the raw logits, as vLLM reports them.
    """
    index = torch.cat([torch.arange(r.row, r.row + r.count) for r in rows]).to(hidden.device)
    targets = torch.tensor(
        [t for r in rows for t in r.request.prompt_token_ids[r.position + 1 : r.position + 1 + r.count]],
        device=hidden.device,
    )
    k = max(r.request.params.prompt_logprobs for r in rows)
    token_logprobs, ranks, top_values, top_ids = [], [], [], []
    for lo in range(0, len(index), SLICE_ROWS):
        logits = model.compute_logits(hidden[index[lo : lo + SLICE_ROWS]])
        if logits is None:  # not the first rank: it only takes part in the gathers
            continue
        logprobs = torch.log_softmax(logits, dim=-1)
        target = targets[lo : lo + SLICE_ROWS, None]
        chosen = logprobs.gather(1, target)
        token_logprobs.append(chosen[:, 0].cpu())
        ranks.append(((logprobs > chosen).sum(dim=-1) + 1).cpu())
        if k:
            top = logprobs.topk(k, dim=-1)
            top_values.append(top.values.cpu())
            top_ids.append(top.indices.cpu())
    if not token_logprobs:
        return {}
    token_logprobs = torch.cat(token_logprobs).tolist()
    ranks = torch.cat(ranks).tolist()
    top_values = torch.cat(top_values).tolist() if k else None
    top_ids = torch.cat(top_ids).tolist() if k else None
    targets = targets.tolist()
    out: dict[str, list[Logprob]] = {}
    i = 0
    for r in rows:
        want = r.request.params.prompt_logprobs
        entries = out.setdefault(r.request.request_id, [])
        for _ in range(r.count):
            top = list(zip(top_ids[i][:want], top_values[i][:want])) if want else []
            entries.append(Logprob(targets[i], token_logprobs[i], top, ranks[i]))
            i += 1
    return out
