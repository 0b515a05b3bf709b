"""POST /v1/embeddings: OpenAI's embeddings API, served by the generation engine (each input is a
prompt-only request whose final hidden states are pooled: engine.worker.pooler)."""

import base64
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from api.errors import APIError
from api.generation import final_response
from api.protocol import EmbeddingRequest
from api.serving import ServingContext
from engine import SamplingParams


async def create_embedding(request: Request) -> Response:
    """One embedding per input (pooled and normalised per --pooler-config), in OpenAI's list shape with
    `usage.prompt_tokens`.

    Raises APIError 400: bad input, token ids outside the vocabulary, an input over max_model_len, or
    `dimensions` (this model's embeddings have one size); 404 unknown model; 503 busy."""
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, EmbeddingRequest)
    if req.dimensions is not None:
        raise APIError(
            400,
            f"dimensions is not supported by this model: its embeddings have {ctx.engine.hidden_size} dimensions",
            param="dimensions",
        )
    inputs = [req.input] if isinstance(req.input, str) or isinstance(req.input[0], int) else req.input
    prompts = [ctx.tokenizer.encode(x) if isinstance(x, str) else x for x in inputs]
    for prompt in prompts:
        ctx.check_token_ids(prompt, "input")
        ctx.max_tokens_for(len(prompt), 0, "input", "input")
    generation = ctx.start(prompts, SamplingParams(max_tokens=0), f"embd-{uuid.uuid4().hex}", pooling=True)

    def body(outputs) -> dict:
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(out.embedding, req.encoding_format)}
            for i, out in enumerate(outputs)
        ]
        tokens = sum(len(p) for p in prompts)
        return {
            "object": "list",
            "data": data,
            "model": ctx.settings.model_id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    return await final_response(request, generation, body)


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    """JSON numbers, or (base64) the float32 little-endian bytes base64-encoded, as OpenAI sends them."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode()
    return embedding
