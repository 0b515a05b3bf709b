"""POST /tokenize and POST /detokenize, in vLLM's request and response shapes, and llama-server's POST
/apply-template (a chat request's prompt as text)."""

from starlette.requests import Request
from starlette.responses import Response

from api.errors import JSONResponse
from api.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from api.serving import ServingContext
from api.serving_chat import render_chat


async def tokenize(request: Request) -> Response:
    """Token ids of a prompt or chat messages (vLLM's /tokenize).

    {"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens", "token_strs"}.

    A prompt is encoded with the tokenizer's special tokens unless add_special_tokens is false;
    messages go through the chat template (whose special tokens are not doubled).
    Raises APIError 400 for an invalid body or messages the template rejects, 404 for an unknown model.
    """
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, TokenizeRequest)
    if req.messages is not None:
        tokens = ctx.encode_chat(req.messages, req.add_generation_prompt, bool(req.add_special_tokens))
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        tokens = ctx.tokenizer.encode(req.prompt, add_special_tokens=add_special)
    token_strs = ctx.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
    return JSONResponse(
        {"count": len(tokens), "max_model_len": ctx.engine.max_model_len, "tokens": tokens, "token_strs": token_strs}
    )


async def detokenize(request: Request) -> Response:
    """Text of token ids (vLLM's /detokenize).

    {"tokens": [ids]} -> {"prompt": text}. Raises APIError 400 for ids outside the vocabulary."""
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, DetokenizeRequest)
    ctx.check_token_ids(req.tokens, "tokens")
    return JSONResponse({"prompt": ctx.tokenizer.decode(req.tokens)})


async def apply_template(request: Request) -> Response:
    """The prompt a chat request would run, as text (llama-server's /apply-template): its messages (an
    assistant's `reasoning_content` included), tools and chat_template_kwargs through the chat template.

    {"messages", "tools"?, ...} -> {"prompt": text}. Raises APIError 400 for an invalid body or messages the
    template rejects, 404 for an unknown model."""
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, ChatCompletionRequest)
    tokens, _ = render_chat(ctx, req)
    return JSONResponse({"prompt": ctx.tokenizer.decode(tokens)})
