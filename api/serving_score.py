"""POST /v1/rerank (and /rerank: Jina's and Cohere's shape) and /score (and /v1/score: vLLM's): how relevant
each document is to a query, scored by the served model in one of two ways (`--score-method`):

- `embedding` (the default; vLLM's score for embedding models): the cosine similarity of the query's and the
  document's pooled embeddings (the /v1/embeddings ones, --pooler-config), in [-1, 1]. Works with any model.
- `judge` (Qwen3-Reranker's recipe, as vLLM serves that model): the pair goes through the chat template as a
  judging conversation (a system message asking for "yes" or "no", a user message of `<Instruct>: ...
  <Query>: ... <Document>: ...`, the assistant's turn opened), and the score is p(yes) / (p(yes) + p(no)) as the
  next token, in (0, 1): two prompt-only requests with prompt logprobs per pair (the last token's is the one
  wanted). For reranker checkpoints; `--rerank-instruction` sets the instruction.
"""

import math
import time
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from api.errors import APIError
from api.generation import final_response
from api.protocol import ChatMessage
from api.protocol_score import RerankRequest, ScoreRequest
from api.serving import ServingContext
from engine import SamplingParams

JUDGE = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the "
    'answer can only be "yes" or "no".'
)


def _answer_token(ctx: ServingContext, word: str) -> int:
    """The token id of `word` as the model's answer. Raises APIError 400 if the tokenizer splits it."""
    ids = ctx.tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise APIError(400, f"this model's tokenizer has no single token for {word!r}: it cannot score")
    return ids[0]


def _pair_prompt(ctx: ServingContext, query: str, document: str) -> list[int]:
    """Token ids of the judging conversation for one (query, document) pair, the assistant's turn opened."""
    instruction = ctx.settings.rerank_instruction
    messages = [
        ChatMessage(role="system", content=JUDGE),
        ChatMessage(role="user", content=f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"),
    ]
    # a thinking model's template (Qwen3's) closes an empty think block when told not to think
    return ctx.encode_chat(messages, True, template_kwargs={"enable_thinking": False})


async def _scores(request: Request, ctx: ServingContext, pairs: list[tuple[str, str]], body):
    """Scores every pair by --score-method; answers `body(scores, prompt_tokens)`. Raises APIError 400 for a
    text or pair over the context."""
    if ctx.settings.score_method == "embedding":
        return await _cosine_scores(request, ctx, pairs, body)
    yes, no = _answer_token(ctx, "yes"), _answer_token(ctx, "no")
    prompts = []
    for query, document in pairs:
        prompt = _pair_prompt(ctx, query, document)
        ctx.max_tokens_for(len(prompt) + 1, 0, "documents", "documents")
        prompts += [prompt + [yes], prompt + [no]]
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    generation = ctx.start(prompts, params, f"score-{uuid.uuid4().hex}")

    def finish(outputs) -> dict:
        last = [out.prompt_logprobs[-1].logprob for out in outputs]
        scores = [1 / (1 + math.exp(n - y)) for y, n in zip(last[0::2], last[1::2])]
        return body(scores, sum(len(p) - 1 for p in prompts[0::2]))

    return await final_response(request, generation, finish)


async def _cosine_scores(request: Request, ctx: ServingContext, pairs: list[tuple[str, str]], body):
    """The cosine similarity of each pair's pooled embeddings (each distinct text embedded once)."""
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    prompts = [ctx.tokenizer.encode(t) for t in texts]
    for prompt in prompts:
        ctx.max_tokens_for(len(prompt), 0, "documents", "documents")
    generation = ctx.start(prompts, SamplingParams(max_tokens=0), f"score-{uuid.uuid4().hex}", pooling=True)

    def finish(outputs) -> dict:
        vectors = dict(zip(texts, (np.asarray(out.embedding, dtype=np.float64) for out in outputs)))
        scores = []
        for query, document in pairs:
            a, b = vectors[query], vectors[document]
            scores.append(float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12)))
        return body(scores, sum(map(len, prompts)))

    return await final_response(request, generation, finish)


async def rerank(request: Request) -> Response:
    """Jina's / Cohere's rerank: `results` sorted by `relevance_score`, the best first, `top_n` of them,
    each with its `index` and, with `return_documents`, its `document`. Raises APIError 400 (bad request, a
    document over the context), 404 (another model), 503 (busy)."""
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, RerankRequest)
    texts = req.texts()

    def body(scores: list[float], tokens: int) -> dict:
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or len(scores)]
        results = [
            {"index": i, "relevance_score": scores[i]}
            | ({"document": {"text": texts[i]}} if req.return_documents else {})
            for i in order
        ]
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": ctx.settings.model_id,
            "usage": {"total_tokens": tokens},
            "results": results,
        }

    return await _scores(request, ctx, [(req.query, t) for t in texts], body)


async def score(request: Request) -> Response:
    """vLLM's /score: `text_1` (one query, or as many as `text_2`) against `text_2`, one score per pair in
    `data`, in order. Raises APIError 400 (lengths that do not pair up), 404, 503."""
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, ScoreRequest)
    pairs = req.pairs()

    def body(scores: list[float], tokens: int) -> dict:
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": ctx.settings.model_id,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    return await _scores(request, ctx, pairs, body)
