"""What the endpoints share: settings, parsing, the checks that need the model, and admission."""

import functools
import logging
import time

import orjson
from jinja2 import TemplateError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from api.drain import Drain
from api.errors import APIError, from_validation_error
from api.generation import Generation
from api.metrics import ServerMetrics
from api.protocol import ChatMessage, SamplingRequest
from api.settings import ServerSettings
from engine import EngineStepError, KVTransferError, SamplingParams, StructuredOutputsParams
from engine.chat_template import encode_chat

logger = logging.getLogger("api")


def validated(model: type[BaseModel], data):
    """`data` validated as `model` (a pydantic model, or anything with `model_validate`). Raises APIError 400
    naming the first field at fault."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def is_json_content_type(value: str) -> bool:
    """Whether a Content-Type header declares JSON, as FastAPI (so vLLM) decides: application/json or
    application/*+json, any parameters (charset) allowed. A request without the header is read as
    JSON too."""
    media_type = value.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


class ServingContext:
    """The engine, settings and metrics behind every endpoint of one app."""

    def __init__(self, engine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.tokenizer
        self.vocab_size = len(engine.tokenizer)
        self.metrics = ServerMetrics(engine, settings.model_id, settings.data_parallel_rank)
        self.created = int(time.time())  # reported as the model's creation time
        self.num_queued = 0  # engine requests accepted that have not produced output yet
        self.drain = Drain()  # requests in flight, and whether the server is shutting down
        # Logprobs name the same few thousand tokens over and over.
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def parse(self, request: Request, model: type[BaseModel]):
        """The JSON body validated as `model`, for the served model. Raises APIError 415 for a body
        that is not declared JSON (see `is_json_content_type`), 400 / 404 for a bad one."""
        content_type = request.headers.get("content-type")
        if content_type and not is_json_content_type(content_type):
            raise APIError(
                415,
                f"unsupported Content-Type {content_type!r}: send the body as JSON with "
                f"`Content-Type: application/json`",
                code="unsupported_media_type",
            )
        try:
            data = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            raise APIError(400, f"malformed JSON body: {e}") from None
        parsed = validated(model, data)
        if parsed.model is not None and parsed.model not in self.settings.model_names:
            raise APIError(
                404,
                f"The model `{parsed.model}` does not exist; this server serves `{self.settings.model_id}`.",
                param="model",
                code="model_not_found",
            )
        return parsed

    def check_token_ids(self, ids, param: str) -> None:
        """Raises APIError 400 unless every id is in the tokenizer's vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param=param)

    def encode_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        add_special_tokens: bool = False,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """Token ids of a conversation (and the tool definitions, for templates that render them) through
        the chat template, given `template_kwargs` (e.g. {"enable_thinking": false}). Raises APIError 400
        when the template rejects it (or the model has none and no --chat-template was given)."""
        try:
            return encode_chat(
                self.tokenizer,
                [m.to_template() for m in messages],
                self.settings.chat_template,
                add_generation_prompt,
                tools,
                add_special_tokens,
                **(template_kwargs or {}),
            )
        except (TemplateError, ValueError, TypeError) as e:
            raise APIError(400, f"the chat template could not render the messages: {e}", param="messages") from None

    def max_tokens_for(self, prompt_len: int, requested: int | None, prompt_param: str, max_param: str) -> int:
        """Output tokens allowed for a prompt: `requested`, or all the room left when None.
        Raises APIError 400, with the numbers, when prompt + output exceed max_model_len."""
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens, and the prompt has "
                f"{prompt_len} tokens, leaving no room for output.",
                param=prompt_param,
            )
        if requested is not None and prompt_len + requested > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                f"completion). Please reduce the length of the prompt or the completion.",
                param=max_param,
            )
        return limit - prompt_len if requested is None else requested

    def sampling_params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams for `req`. Raises APIError 400 for values that need the model."""
        self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        self.check_token_ids(req.logit_bias, "logit_bias")
        if req.min_tokens > max_tokens:
            raise APIError(
                400,
                f"min_tokens ({req.min_tokens}) must be <= the maximum output tokens ({max_tokens})",
                param="min_tokens",
            )
        try:
            return req.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            # SamplingParams' messages start with the field's name, which is also the request's.
            field = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param=field if field in type(req).model_fields else None) from None

    async def constrain(self, params: SamplingParams, spec: StructuredOutputsParams | None, param: str | None) -> None:
        """Sets `params.structured_outputs` to `spec` once its grammar has compiled (off the event loop,
        bounded by the engine's compile_timeout), so a bad constraint fails before any engine work.

        Raises APIError 400 naming `param`: invalid constraint, compile timeout, or xgrammar not installed.
        """
        if spec is None:
            return
        try:
            await self.engine.compile_grammar(spec)
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
        params.structured_outputs = spec

    def start(
        self, prompts: list[list[int]], params: SamplingParams, request_id: str, pooling: bool = False
    ) -> Generation:
        """Admits an API request and starts its engine requests, one per prompt (embedding requests
        with `pooling`).

        Raises APIError 503 (with Retry-After) when the engine is not running or the queue is full.
        """
        if not self.engine.is_alive:
            raise APIError(503, "the engine is not running", headers={"Retry-After": "5"})
        if params.extra_args and len(prompts) > 1:  # one kv_transfer_params in and out per response
            raise APIError(400, "kv_transfer_params needs a single prompt", param="kv_transfer_params")
        limit = self.settings.max_queue_len
        if limit is not None and self.num_queued >= limit:
            raise APIError(
                503,
                f"server busy: {self.num_queued} requests are waiting (--max-queue-len {limit}); retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        return Generation(self, prompts, params, request_id, pooling)

    def engine_error(self, error: Exception) -> APIError:
        """The API error for an exception raised by `engine.generate`."""
        if isinstance(error, ValueError):
            return APIError(400, str(error))
        if isinstance(error, KVTransferError):
            return APIError(
                500,
                f"the prompt's KV cache could not be pulled from the prefill server: {error.reason}",
                param="kv_transfer_params",
                code="kv_transfer_failed",
            )
        if isinstance(error, EngineStepError):
            # The engine logged the traceback; the client learns only that its step failed.
            return APIError(500, "the engine step running this request failed; it was aborted")
        if not self.engine.is_alive:
            return APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        logger.error("engine request failed", exc_info=error)
        return APIError(500, "internal server error; the server log has the details")
