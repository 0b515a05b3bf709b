"""N-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's NgramProposer): propose the
tokens that followed the last n tokens the previous time they occurred in the request."""

import numpy as np


def find_ngram_proposal(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix n-gram.

    tokens: int64 [N], the request's prompt + output. The longest n in [min_n, max_n] such that the
    last n tokens occur earlier (an occurrence may overlap the suffix, as in vLLM) wins; among its
    occurrences the earliest; the proposal is what followed it, cut at the end of `tokens` (so it
    can run into the suffix itself) and at k. Empty when no n >= min_n matches or k <= 0.
    Example (vLLM's docstring): [1,2,3,4,2,3], min 2, max 3, k 4 -> [4,2,3].

    One pass per n over the surviving candidates: end positions i < N-1 where tokens[i-m] equals
    tokens[N-1-m] for every m < n; the candidate set only shrinks as n grows.
    """
    if k <= 0 or len(tokens) < 2:
        return []
    last = len(tokens) - 1
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # end positions of earlier 1-gram matches
    best = ends[0] if ends.size and min_n <= 1 else None
    for n in range(2, max_n + 1):
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[last - (n - 1)]]
        if ends.size == 0:
            break
        if n >= min_n:
            best = ends[0]
    if best is None:
        return []
    return tokens[best + 1 : best + 1 + k].tolist()


class NgramProposer:
    """Proposes by `find_ngram_proposal` over each request's prompt + output (no model, no state).

    Cheap enough to run for every request each step, so the speculator also uses proposals it does
    not send to score how well lookup would do (see policy.py).
    """

    cheap = True
    max_model_len = None  # no limit of its own

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def init_kv_cache(self, num_blocks: int) -> None:
        pass

    def propose(self, requests: list, lengths: list[int]) -> list[tuple[list[int], None]]:
        """Up to lengths[i] draft tokens for requests[i], with q = None (one-hot)."""
        return [
            (find_ngram_proposal(np.array(r.all_token_ids, dtype=np.int64), self.min_n, self.max_n, k), None)
            if k > 0
            else ([], None)
            for r, k in zip(requests, lengths)
        ]

    def free(self, request_id: str) -> None:
        pass
