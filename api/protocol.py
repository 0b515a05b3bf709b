"""Request bodies of the OpenAI endpoints plus vLLM's extra sampling fields, validated by pydantic v2.

Types are strict as in OpenAI's API ("0.5" is not a number, true is not an integer), non-finite
numbers are rejected, `null` means "use the default", and unknown fields are ignored as vLLM does.
Checks that need the model (token id ranges, context length) are in `api.serving`.
"""

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from engine import SamplingParams

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
TokenId = Annotated[int, Field(ge=0)]
# Bounds on lists whose cost grows with their length at every step (stop strings and ids are checked
# per generated token) or per request (each prompt is an engine request): far above real use, they
# keep one request from stalling everyone else. OpenAI allows 4 stop strings; vLLM has no bounds.
MAX_STOP, MAX_STOP_TOKEN_IDS, MAX_PROMPTS = 64, 1024, 1024


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`: OpenAI's named schema (`strict` is accepted; it is always enforced)."""

    name: str
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: "text" (no constraint), "json_object" or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only then')
        return self


class StructuredOutputsRequest(_Body):
    """vLLM's `structured_outputs` object; unknown keys are refused, never ignored."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] = []
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] = {}
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field([], max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's pre-0.12 names, still sent by many clients (vLLM now ignores them; they are honoured here)
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's disaggregated prefill/decode handshake (engine.kv_transfer); ignored without --kv-transfer-config
    kv_transfer_params: dict | None = None

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop):
        stop = [stop] if isinstance(stop, str) else stop
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias) -> dict[int, float]:
        """JSON keys are strings; they become token ids (ASCII digits, short enough to be one)."""
        if not all(k.isascii() and k.isdigit() and len(k) <= 18 for k in bias):
            raise ValueError("logit_bias keys must be token ids (non-negative integers as strings)")
        return {int(k): v for k, v in bias.items()}

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options, info: ValidationInfo):
        if not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    @field_validator("kv_transfer_params")
    @classmethod
    def _prefill_is_not_streamed(cls, params, info: ValidationInfo):
        if params.get("do_remote_decode") and info.data.get("stream"):
            raise ValueError("do_remote_decode needs stream: false (the params come back in the response body)")
        return params

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters for this request; `max_tokens` already resolved against the context.

        Raises:
            ValueError: SamplingParams rejected a combination (its message names the field).
        """
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=self.stop,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias or None,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=self.engine_prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            extra_args={"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params else None,
        )

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: top alternatives per prompt token, None for none."""
        return self.prompt_logprobs


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `echo` with `logprobs` also scores the prompt; `max_tokens` 0 (with echo)
    scores it without generating, as lm-evaluation-harness and vLLM use it."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def engine_prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt):
        if not prompt or (isinstance(prompt, list) and any(not p for p in prompt)):
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and not isinstance(prompt[0], int) and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list, each a string or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return self.prompt


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """A conversation message; an assistant's may carry `tool_calls` (content may then be null) and its earlier
    reasoning (`reasoning_content`, vLLM's and llama.cpp's field, rendered by templates that show it), and a
    "tool" message answers the call `tool_call_id`."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _fields_of_role(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool messages need tool_call_id, and only they take it")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        return self

    def to_template(self) -> dict:
        """The message as chat templates expect it: text parts joined with newlines (as vLLM does), tool
        call arguments as objects (templates render them with tojson; text that is not JSON stays text)."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or ())
        message = {"role": self.role, "content": content} | ({"name": self.name} if self.name else {})
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None = no arguments
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions. `max_completion_tokens` wins over the older `max_tokens`; without
    either the reply may fill the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None  # vLLM's: extra variables for the chat template
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs, info: ValidationInfo):
        if not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top_logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        """SamplingParams.logprobs: how many top alternatives per token, None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM): either `prompt` or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (vLLM's defaults)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM)."""

    model: str | None = None
    tokens: list[TokenId]


class EmbeddingRequest(_Body):
    """POST /v1/embeddings (OpenAI's): `input` is a string, a list of strings, token ids, or a list of
    token-id lists; `encoding_format` float (JSON numbers) or base64 (little-endian float32 bytes)."""

    model: str | None = None
    input: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
