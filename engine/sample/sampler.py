"""Turning logits into sampling distributions and draws: logit processors, temperature, top-k/top-p,
min-p, the exponential race, logprobs. The step's sampler is `RejectionSampler` (rejection_sampler.py),
which uses these for rows with and without draft tokens alike."""

from typing import Protocol

import torch

from engine.outputs import Logprob
from engine.sampling_params import SamplingParams


class SamplingView(Protocol):
    """What sampling reads of the sequence behind one logits row: a request, or a request seen as if
    its draft tokens so far had been generated (`rejection_sampler.WithDrafts`)."""

    params: SamplingParams
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def all_token_ids(self) -> list[int]: ...


class Sampler:
    """Processes logits row by row and draws from them, for the rows' `SamplingView`s.

    Order, as in vLLM: (the grammar mask, applied by the caller first) logit_bias, min_tokens (EOS and
    stop tokens banned), repetition/presence/frequency penalties; then greedy rows take the argmax and
    the others apply temperature, top-k, top-p (nucleus, Holtzman et al. 2019) and min-p before drawing
    with the exponential race (argmax p / E, E ~ Exp(1)), which a seeded request draws from its own
    generator so its samples do not depend on the rest of the batch. Logprobs come from the raw
    logits (grammar-masked).
    """

    def _process(self, logits, requests):
        logits = logits.clone() if any(_needs_processing(r) for r in requests) else logits
        for i, r in enumerate(requests):
            p = r.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
            if len(r.output_token_ids) < p.min_tokens:
                banned = list(r.eos_token_ids) + p.stop_token_ids
                if banned:
                    logits[i, banned] = float("-inf")
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(r.all_token_ids, dtype=torch.long).unique()
                row = logits[i, seen]
                logits[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
                counts = torch.bincount(torch.tensor(r.output_token_ids), minlength=logits.shape[1])
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            if p.thinking_token_budget is not None:
                forced = forced_thinking_end(r.output_token_ids, p.thinking_token_budget, p.thinking_end_token_ids)
                if forced is not None:
                    logits[i] = torch.where(torch.arange(logits.shape[1]) == forced, logits[i], float("-inf"))
        return logits

    def _probs(self, logits, requests):
        """Sampling distributions [N, vocab] of processed logits: temperature, top-k/top-p, min-p."""
        temps = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype)
        logits = logits / temps[:, None]
        top_k = [r.params.top_k for r in requests]
        top_p = [r.params.top_p for r in requests]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([r.params.min_p for r in requests], dtype=probs.dtype)
        if min_p.any():
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    @staticmethod
    def _draw(probs, requests):
        """One token per row of (unnormalised) `probs` by the exponential race, each row from its
        request's generator."""
        noise = torch.empty_like(probs)
        for i, r in enumerate(requests):
            noise[i].exponential_(generator=r.generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprob(row: torch.Tensor, token_id: int, top_n: int) -> Logprob:
        top = []
        if top_n:
            values, ids = row.topk(top_n)
            top = list(zip(ids.tolist(), values.tolist()))
        return Logprob(token_id, row[token_id].item(), top)


def forced_thinking_end(output: list[int], budget: int, end: list[int]) -> int | None:
    """The token a thinking budget forces next, or None: once `budget` tokens are out and the end-of-thinking
    sequence `end` is not among them, its next token (the end may already be partly written, by the model or
    by earlier forcing)."""
    if len(output) < budget:
        return None
    n = len(end)
    if any(output[i : i + n] == end for i in range(len(output) - n + 1)):
        return None  # thinking ended
    written = next((k for k in range(n - 1, 0, -1) if output[-k:] == end[:k]), 0)
    return end[written]


def _needs_processing(r) -> bool:
    p = r.params
    return bool(
        p.logit_bias
        or p.min_tokens
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
        or p.thinking_token_budget is not None
    )


def _top_k_top_p(logits, top_k: list[int], top_p: list[float]):
    """Masks to -inf every token outside each row's top-k and smallest top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k])
    ranks = torch.arange(vocab)[None, :]
    mask = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    # drop a token when the tokens ranked above it already cover top_p
    mask |= (probs.cumsum(dim=-1) - probs) >= torch.tensor(top_p)[:, None]
    sorted_logits.masked_fill_(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
