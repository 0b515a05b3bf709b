"""Verifying drafts: speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative
Sampling"), as vLLM's vllm/v1/sample/rejection_sampler.py; and drawing draft tokens with their q."""

import numpy as np
import torch

from engine.outputs import Logprob
from engine.sample.bitmask import apply_token_bitmask
from engine.sample.sampler import Sampler, _needs_processing
from models.kernels import ops


class WithDrafts:
    """A request seen as if `extra` tokens followed its output: the `SamplingView` of draft position j
    (penalties and min_tokens count the drafts before j, as without speculation), or a request with the
    tokens it just sampled, which the proposers of engine/spec_decode draft after."""

    def __init__(self, request, extra: list[int]):
        self.request, self.extra = request, extra
        self.params, self.eos_token_ids, self.generator = request.params, request.eos_token_ids, request.generator

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.extra

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.extra

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens + len(self.extra)


class RejectionSampler(Sampler):
    """Turns the target's logits at a request's 1 + d positions into its new tokens.

    Row j of a request with drafts x_1..x_d holds the target's logits after x_1..x_j. They go through
    the same processing as ordinary sampling (logit_bias, min_tokens, penalties over output + x_<=j,
    temperature, top-k, top-p, min-p) into p_j. Then, position by position:
    - greedy rows accept x_{j+1} while it equals argmax p_j, and emit argmax p_j at the first
      mismatch, or after all d as the bonus token: exactly the tokens of decoding without drafts;
    - random rows accept x_{j+1} with probability min(1, p_j(x)/q_j(x)), u ~ U[0, 1) in float64; at
      the first rejection they emit a token from normalised max(0, p_j - q_j), after all d a bonus
      token from p_d. q is one-hot (n-gram, greedy drafts) unless the request carries
      `spec_token_probs`. The output is distributed exactly as p (the papers' theorem).
    Draws come from the request's generator when seeded: d uniforms, then one exponential row for
    the last token (the exponential race, argmax w / E, needs no normalisation). A request with no
    drafts draws exactly what `Sampler` draws, so its tokens are the same as without speculation.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list,
        grammar_bitmask: np.ndarray | None = None,
        grammar_rows: list[int] = (),
        argmax: torch.Tensor | None = None,
    ) -> tuple[list[list[int]], list[list[Logprob | None]]]:
        """logits: float32 [sum(1 + d_i), vocab], the rows of each request in order (d_i =
        len(request.spec_token_ids)). grammar_bitmask: int32 [len(grammar_rows), ceil(vocab / 32)], the
        tokens allowed to requests[grammar_rows[k]] (structured outputs; such requests have no drafts).
        argmax: int64 [rows], each logits row's argmax (ops.argmax's) where the caller has it (the model computed it
        with the logits: engine/worker/model_runner.py), or None.
        Returns each request's new tokens (accepted drafts + one more) and their Logprob|None (from the
        raw logits, as `Sampler`)."""
        if grammar_bitmask is None and all(_plain_greedy(r) for r in requests):  # the common decode: one argmax a row
            tokens = ops.argmax(logits) if argmax is None else argmax
            return [[t] for t in tokens.tolist()], [[None] for _ in requests]
        views = [WithDrafts(r, r.spec_token_ids[:j]) for r in requests for j in range(len(r.spec_token_ids) + 1)]
        if grammar_bitmask is not None:
            first_row = np.cumsum([0] + [len(r.spec_token_ids) + 1 for r in requests])
            apply_token_bitmask(logits, grammar_bitmask, [int(first_row[i]) for i in grammar_rows])
        want = any(r.params.logprobs is not None for r in requests)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want else None
        logits = self._process(logits, views)
        greedy = ops.argmax(logits).tolist()
        random_rows = [i for i, v in enumerate(views) if not v.params.greedy]
        probs = {}
        if random_rows:
            idx = torch.tensor(random_rows)
            probs = dict(zip(random_rows, self._probs(logits[idx], [views[i] for i in random_rows])))
        tokens, logprobs, row = [], [], 0
        for r in requests:
            drafts = r.spec_token_ids
            if r.params.greedy:
                out = _verify_greedy(drafts, greedy[row : row + len(drafts) + 1])
            else:
                out = _verify_random(
                    drafts, [probs[row + j] for j in range(len(drafts) + 1)], r.spec_token_probs, r.generator
                )
            tokens.append(out)
            logprobs.append(
                [
                    self._logprob(raw_logprobs[row + j], t, r.params.logprobs)
                    if r.params.logprobs is not None
                    else None
                    for j, t in enumerate(out)
                ]
            )
            row += len(drafts) + 1
        return tokens, logprobs

    def sample_draft(self, logits: torch.Tensor, views: list) -> tuple[list[int], list[torch.Tensor | None]]:
        """A draft model's next token per row, with the distribution q it was drawn from.

        logits: float32 [N, vocab], the draft's logits for `views` (requests `WithDrafts` with their
        drafts so far), processed like the target's. Greedy rows take the argmax (q one-hot: None);
        random rows draw from q, and q [vocab] is returned for their verification.
        """
        logits = self._process(logits, views)
        tokens = logits.argmax(dim=-1).tolist()
        qs: list[torch.Tensor | None] = [None] * len(views)
        random_rows = [i for i, v in enumerate(views) if not v.params.greedy]
        if random_rows:
            sub = [views[i] for i in random_rows]
            q = self._probs(logits[torch.tensor(random_rows)], sub)
            for i, t, q_row in zip(random_rows, self._draw(q, sub).tolist(), q):
                tokens[i], qs[i] = t, q_row
        return tokens, qs


def _plain_greedy(r) -> bool:
    """A greedy request without drafts, logprobs or logits processing: its token is its raw logits' argmax, what the
    general path computes for it."""
    p = r.params
    return not r.spec_token_ids and p.greedy and p.logprobs is None and not _needs_processing(r)


def _verify_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """targets: argmax p_j for j = 0..d. Accepted drafts, then the target's token where they part."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return drafts[:n] + [targets[n]]


def _verify_random(drafts: list[int], p: list[torch.Tensor], q: torch.Tensor | None, generator) -> list[int]:
    """p: d + 1 target distributions [vocab]; q: [>= d, vocab] draft distributions, None = one-hot."""
    d = len(drafts)
    n = 0
    if d:
        u = torch.rand(d, dtype=torch.float64, generator=generator).tolist()
        while n < d:
            x = drafts[n]
            q_x = 1.0 if q is None else float(q[n, x])
            if q_x > 0 and float(p[n][x]) >= u[n] * q_x:
                n += 1
            else:
                break
    last = p[n]
    if n < d:  # rejected: the residual max(0, p - q) corrects for what the draft over-proposed
        residual = last.clone()
        if q is None:
            residual[drafts[n]] = 0.0
        else:
            residual = (residual - q[n]).clamp_(min=0.0)
        # all zero only when p == q up to rounding, where rejection had probability ~0: draw from p
        last = residual if residual.sum() > 0 else last
    noise = torch.empty_like(last).exponential_(generator=generator)
    return drafts[:n] + [int((last / noise).argmax())]
