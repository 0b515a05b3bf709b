"""The rejection sampler: greedy verification token by token, and for random rows an output
distributed as the target's processed distribution p (chi-square), with one-hot and non-one-hot
draft distributions q; seeded requests reproduce their tokens."""

from types import SimpleNamespace

import pytest
import torch

from engine import SamplingParams
from engine.sample.rejection_sampler import RejectionSampler

VOCAB = 10
# chi-square critical value for 9 degrees of freedom at p = 1e-4: a correct sampler fails ~1 in 10^4
CHI2_CRITICAL_9DF = 33.72


def request(drafts, params: SamplingParams, q=None, seed=None, output=()):
    return SimpleNamespace(
        spec_token_ids=list(drafts),
        spec_token_probs=q,
        params=params,
        generator=None if seed is None else torch.Generator().manual_seed(seed),
        output_token_ids=list(output),
        all_token_ids=[1, 2, 3] + list(output),
        eos_token_ids=frozenset(),
        grammar=None,
    )


def one_hot_logits(token_ids):
    logits = torch.full((len(token_ids), VOCAB), -10.0)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 10.0
    return logits


GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize(
    "drafts, targets, expected",
    [
        ([4, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7]),  # all accepted + bonus
        ([4, 5, 6], [4, 9, 6, 7], [4, 9]),  # second rejected: the target's token replaces it
        ([4, 5, 6], [8, 5, 6, 7], [8]),  # first rejected
        ([], [3], [3]),  # no draft: plain greedy
    ],
)
def test_greedy_rows_follow_the_target_argmax(drafts, targets, expected):
    tokens, logprobs = RejectionSampler()(one_hot_logits(targets), [request(drafts, GREEDY)])
    assert tokens == [expected] and logprobs == [[None] * len(expected)]


def test_greedy_batch_with_logprobs_and_logit_processing():
    # logit_bias makes token 2 the target at every position; the draft [2, 2] is fully accepted
    biased = SamplingParams(temperature=0, logit_bias={2: 30.0}, logprobs=1)
    reqs = [request([2, 2], biased), request([5], GREEDY), request([], GREEDY)]
    logits = one_hot_logits([7, 7, 7, 5, 1, 9])
    tokens, logprobs = RejectionSampler()(logits, reqs)
    assert tokens == [[2, 2, 2], [5, 1], [9]]
    # logprobs come from the raw logits (before logit_bias), as without speculation
    assert [lp.token_id for lp in logprobs[0]] == [2, 2, 2]
    assert logprobs[0][0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())


def chi_square(samples: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    expected = p.double() * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def run_many(logits_rows, drafts_of, q_of, params, n):
    """n requests sharing the target logits rows [d + 1, VOCAB]; returns their token lists."""
    reqs = [request(drafts_of(i), params, q_of(i)) for i in range(n)]
    logits = logits_rows.repeat(n, 1)
    return RejectionSampler()(logits, reqs)[0]


@pytest.mark.parametrize("one_hot_q", [True, False])
def test_random_rows_are_distributed_as_the_target(one_hot_q):
    torch.manual_seed(0)
    n = 8000
    params = SamplingParams(temperature=0.8, top_k=8)
    logits = torch.randn(3, VOCAB) * 1.5  # two draft positions + bonus
    # the target p: temperature, then the top 8 of each row
    scaled = logits / 0.8
    p = torch.softmax(scaled.masked_fill(scaled < scaled.topk(8).values[:, -1:], float("-inf")), -1)
    if one_hot_q:  # n-gram: a fixed draft, q one-hot; the draft token at position 0 is likely
        first = int(p[0].argmax())
        drafts_of, q_of = (lambda i: [first, 3]), (lambda i: None)
    else:  # a draft model: drafts drawn from q, a distribution unlike p (covering tokens p excludes)
        q = torch.softmax(torch.randn(2, VOCAB), -1)
        drawn = torch.multinomial(q, n, replacement=True).T  # [n, 2]
        drafts_of, q_of = (lambda i: drawn[i].tolist()), (lambda i: q)
    tokens = run_many(logits, drafts_of, q_of, params, n)
    first_tokens = torch.tensor([t[0] for t in tokens])
    assert chi_square(first_tokens, p[0]) < CHI2_CRITICAL_9DF
    # the token after an accepted first draft is distributed as p at position 1
    second = torch.tensor([t[1] for i, t in enumerate(tokens) if len(t) > 1])
    assert len(second) > 1000
    assert chi_square(second, p[1]) < CHI2_CRITICAL_9DF
    assert 1 < sum(len(t) for t in tokens) / n < 3  # some drafts accepted, some rejected


def test_seeded_requests_reproduce_their_tokens():
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(4, VOCAB)

    def run(seed):
        reqs = [request([1, 2, 3], params, seed=seed), request([4, 4, 4], params, seed=seed + 1)]
        return RejectionSampler()(logits.repeat(2, 1), reqs)[0]

    runs = [run(7) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert any(run(s) != runs[0] for s in range(100, 110))


def test_no_draft_row_draws_the_exponential_race_of_plain_sampling():
    """Without drafts a row draws argmax p / E with E ~ Exp(1) from the request's own generator, p the
    top-p-filtered softmax: what sampling without speculation draws, seed for seed."""
    params = SamplingParams(temperature=0.7, top_p=0.9)
    logits = torch.randn(1, VOCAB)
    ours = [RejectionSampler()(logits.clone(), [request([], params, seed=s)])[0][0][0] for s in range(30)]
    probs = torch.softmax(logits[0] / 0.7, dim=-1)
    order = probs.argsort(descending=True)
    covered = probs[order].cumsum(0) - probs[order]  # mass of the tokens ranked above each
    nucleus = torch.zeros_like(probs).scatter_(0, order, (covered < 0.9).float()) * probs
    reference = [
        int((nucleus / torch.empty(VOCAB).exponential_(generator=torch.Generator().manual_seed(s))).argmax())
        for s in range(30)
    ]
    assert ours == reference and len(set(ours)) > 1


def test_penalties_see_the_drafts_before_each_position():
    # position 1 slightly prefers token 2 over 5; the draft already holds a 2 there, so a presence
    # penalty moves the target to 5, exactly as without speculation after sampling that 2
    logits = torch.zeros(3, VOCAB)
    logits[0, 2] = 5.0
    logits[1, 2], logits[1, 5] = 4.0, 3.5
    logits[2, 7] = 5.0
    penalized = SamplingParams(temperature=0, presence_penalty=1.0)
    assert RejectionSampler()(logits, [request([2, 2], penalized)])[0] == [[2, 5]]
    assert RejectionSampler()(logits, [request([2, 2], GREEDY)])[0] == [[2, 2, 7]]


def test_thinking_budget_forces_the_end_of_thinking():
    """forced_thinking_end: nothing before the budget; then the end sequence token by token (resuming a partly
    written end); nothing once the end is out."""
    from engine.sample.sampler import forced_thinking_end

    end = [7, 8, 9]
    assert forced_thinking_end([1, 2], 3, end) is None
    assert forced_thinking_end([1, 2, 3], 3, end) == 7
    assert forced_thinking_end([1, 2, 3, 7], 3, end) == 8
    assert forced_thinking_end([1, 2, 3, 7, 8], 3, end) == 9
    assert forced_thinking_end([1, 2, 3, 7, 8, 9], 3, end) is None
    assert forced_thinking_end([7, 8, 9, 4, 5], 3, end) is None  # the model closed it itself
    assert forced_thinking_end([1, 2, 3, 4], 0, end) == 7  # a budget of 0: no thinking at all
