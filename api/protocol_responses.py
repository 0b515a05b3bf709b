"""The request body of OpenAI's Responses API (POST /v1/responses), validated by pydantic v2 in the style of
`api.protocol`: strict types, `null` means the default, unknown fields are ignored.

Only what this server can honour is accepted: function tools, text / JSON-schema / JSON-object output, and the
whole conversation sent as `input` (nothing is stored). A field that would change the output and is not
supported (another tool type, `previous_response_id`, `include`, reasoning summaries, ...) is refused with 400, never
ignored. The field names and shapes are OpenAI's (the openai SDK's `openai/types/responses/`).
"""

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from api.protocol import ChatCompletionRequest, _Body
from engine import StructuredOutputsParams

# Fields that would change the output and are not supported, with the reason the 400 gives. Their inert
# values (false, 0, "disabled", empty, or an object of nulls) are accepted: they ask for the default.
_REFUSED = {
    "previous_response_id": "this server stores no responses; send the whole conversation as `input`",
    "conversation": "this server stores no conversations; send the whole conversation as `input`",
    "prompt": "this server stores no prompt templates",
    "background": "this server stores no responses, so none runs in the background",
    "include": "this server has no extra output data to include",
    "top_logprobs": "this server returns no logprobs on /v1/responses",
    "truncation": '"auto" would drop input items; only "disabled" is served (input too long for the context gets 400)',
}


class TextPart(_Body):
    """A text part of a message: `input_text` (user, system, developer) or `output_text` (an assistant
    message, as a previous response returned it)."""

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Body):
    """An input message (OpenAI's EasyInputMessage; `type` may be left out). "developer" is OpenAI's newer
    name for "system" and is rendered as a system message."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(_Body):
    """A function call the model made earlier (a `function_call` output item sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class FunctionCallOutputItem(_Body):
    """The result of the call `call_id`, as text (or text parts)."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(_Body):
    """The model's reasoning from an earlier response (a `reasoning` output item sent back): its `content` text
    becomes the next assistant message's `reasoning_content` (rendered where the chat template shows past
    reasoning). `summary` and `encrypted_content` are accepted; this server writes neither."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict] = []
    content: list[TextPart | dict] | None = None
    encrypted_content: str | None = None

    def text(self) -> str:
        """The reasoning text of its `reasoning_text` parts."""
        parts = self.content or []
        return "".join(p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "reasoning_text")


def _item_type(item) -> str | None:
    """The discriminator of input items: messages may leave `type` out."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class ReasoningConfig(_Body):
    """`reasoning`: `effort` goes to the chat template as `reasoning_effort` (as vLLM passes it; gpt-oss's
    template reads it), and "none" also asks it not to open a think block (`enable_thinking` false, Qwen3's).
    `summary` "auto" lets the server decide, and none is written (the reasoning itself comes as the reasoning
    item's text); "concise" and "detailed" are refused: nothing here summarizes."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name of `summary`

    @model_validator(mode="after")
    def _no_summaries(self):
        for field in ("summary", "generate_summary"):
            if getattr(self, field) not in (None, "auto"):
                raise ValueError(f'{field} {getattr(self, field)!r}: no reasoning summaries are written; use "auto"')
        return self

    def template_kwargs(self) -> dict:
        """The chat template variables for this config."""
        if self.effort is None:
            return {}
        return {"reasoning_effort": self.effort} | ({"enable_thinking": False} if self.effort == "none" else {})


class FunctionTool(_Body):
    """A function the model may call (OpenAI's FunctionToolParam, flat: no `function` wrapper as in chat).
    Other tool types (web_search, file_search, mcp, custom, ...) are refused: nothing here runs them."""

    type: str
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None = no arguments
    strict: bool | None = None  # accepted; the arguments always follow `parameters` when a grammar forces the call

    @field_validator("type")
    @classmethod
    def _function_only(cls, kind: str) -> str:
        if kind != "function":
            raise ValueError(f'tool type {kind!r} is not supported; only "function" tools are')
        return kind


class NamedFunctionChoice(_Body):
    """`tool_choice` forcing a call of the function `name`."""

    type: Literal["function"]
    name: str


class TextFormatText(_Body):
    """Plain text output (the default): no constraint."""

    type: Literal["text"]


class TextFormatJsonObject(_Body):
    """Output that is a JSON object, any schema."""

    type: Literal["json_object"]


class TextFormatJsonSchema(_Body):
    """Output following `schema` (`strict` is accepted; it is always enforced)."""

    type: Literal["json_schema"]
    name: str
    json_schema: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    """`text`: the output's format; `verbosity` only at its default, "medium" (the served models have no
    verbosity setting)."""

    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")] = (
        TextFormatText(type="text")
    )
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("verbosity")
    @classmethod
    def _default_only(cls, verbosity: str) -> str:
        if verbosity != "medium":
            raise ValueError(f'verbosity {verbosity!r} is not supported; only "medium" (the default) is')
        return verbosity

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The engine's output constraint for `format`, None for plain text."""
        if isinstance(self.format, TextFormatJsonSchema):
            return StructuredOutputsParams(json=self.format.json_schema)
        if isinstance(self.format, TextFormatJsonObject):
            return StructuredOutputsParams(json_object=True)
        return None


class ResponsesRequest(_Body):
    """POST /v1/responses (OpenAI's Responses API, stateless). `input` is a string (one user message) or a
    list of items: messages, `function_call` and `function_call_output`. `instructions` comes first as a
    system message. `store` is accepted, but nothing is stored."""

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    tools: list[FunctionTool] = []
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = TextConfig()
    stream: bool = False
    store: bool = True
    user: str | None = None
    metadata: dict[str, str] | None = None
    chat_template_kwargs: dict | None = None  # vLLM's: extra variables for the chat template
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    background: bool = False
    include: list[str] = []
    reasoning: ReasoningConfig | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] = "disabled"

    @field_validator(*_REFUSED)
    @classmethod
    def _refuse_unsupported(cls, value, info: ValidationInfo):
        inert = value in (False, 0, "disabled", []) or (
            isinstance(value, dict) and all(v is None for v in value.values())
        )
        if not inert:
            raise ValueError(f"not supported: {_REFUSED[info.field_name]}")  # the error names the field
        return value

    def chat_request(self) -> ChatCompletionRequest:
        """This request as the chat completion it runs as (the output format aside: see
        `TextConfig.structured_outputs`): the items as chat messages, consecutive `function_call` items
        as one assistant message's tool_calls (after the assistant's text, if any), `function_call_output`
        items as "tool" messages; the tools and tool_choice in chat's shape. Every field was validated
        here with chat's own constraints, so this does not fail."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        reasoning = None  # a reasoning item's text, for the assistant message that follows it
        for item in items:
            if isinstance(item, ReasoningItem):
                reasoning = (reasoning or "") + item.text()
                continue
            if reasoning is not None and not (
                isinstance(item, FunctionCallItem) or (isinstance(item, MessageItem) and item.role == "assistant")
            ):
                messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
                reasoning = None
            if isinstance(item, MessageItem):
                messages.append(
                    {
                        "role": "system" if item.role == "developer" else item.role,
                        "content": _chat_content(item.content),
                    }
                    | ({"reasoning_content": reasoning} if reasoning is not None and item.role == "assistant" else {})
                )
                reasoning = None if item.role == "assistant" else reasoning
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                if messages and messages[-1]["role"] == "assistant" and reasoning is None:
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    if reasoning is not None:
                        messages[-1]["reasoning_content"], reasoning = reasoning, None
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _chat_content(item.output)})
        if reasoning is not None:  # reasoning last: an assistant turn of reasoning alone
            messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
        tools = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
        ]
        choice = self.tool_choice
        if isinstance(choice, NamedFunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        elif choice == "auto" and not tools:
            choice = None  # OpenAI's default, also without tools; chat would ask for tools
        return ChatCompletionRequest.model_validate(
            {
                "messages": messages,
                "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "tools": tools or None,
                "tool_choice": choice,
                "parallel_tool_calls": self.parallel_tool_calls,
                "user": self.user,
                "chat_template_kwargs": (self.reasoning.template_kwargs() if self.reasoning else {})
                | (self.chat_template_kwargs or {})
                or None,
            }
        )

    def echo(self) -> dict:
        """The request fields a Response object repeats (OpenAI's `Response` type requires several)."""
        choice = self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": self.reasoning.model_dump(exclude={"generate_summary"}) if self.reasoning else None,
            "background": False,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "text": self.text.model_dump(by_alias=True, exclude_none=True),
            "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in self.tools],
            "truncation": self.truncation,
            "user": self.user,
        }


def _chat_content(content: str | list[TextPart]) -> str | list[dict]:
    """Message content in chat's shape: text parts become chat text parts (joined as chat joins them)."""
    return content if isinstance(content, str) else [{"type": "text", "text": p.text} for p in content]
