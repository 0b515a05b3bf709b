"""Request bodies of Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens), validated by
pydantic v2 in the style of `api.protocol`: strict types, `null` means the default, unknown fields are ignored.
The field names and shapes are Anthropic's (the anthropic SDK's `anthropic/types/`: MessageCreateParams,
MessageParam, ToolParam, ToolChoiceParam).

A request runs as the chat completion it amounts to (`chat_request`): text, `tool_use` and `tool_result` blocks
become chat messages, tool calls and "tool" messages, an assistant's `thinking` blocks its `reasoning_content`;
`tools` and `tool_choice` become chat's. Content this server cannot read (images, documents, redacted thinking) and
server tools (web search, ...) are refused with 400.
"""

import json
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from api.protocol import MAX_STOP, ChatCompletionRequest, _Body


class TextBlock(_Body):
    """A `text` content block (Anthropic's TextBlockParam; `cache_control` and `citations` are ignored)."""

    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    """A tool call the model made earlier (an assistant's `tool_use` block sent back): `input` is its arguments."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(_Body):
    """The result of the call `tool_use_id`, as text or text blocks. `is_error` is accepted; chat templates have
    no place for it, so the content has to say what failed."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Body):
    """An assistant's earlier reasoning sent back (Anthropic's ThinkingBlockParam): rendered as the message's
    `reasoning_content` where the chat template shows past reasoning. `signature` is accepted (nothing here
    signs or checks it)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


def _chat_content(content: str | list[TextBlock]) -> str | list[dict]:
    """Content in chat's shape: text blocks become chat text parts (joined with newlines by the template step)."""
    return content if isinstance(content, str) else [{"type": "text", "text": b.text} for b in content]


class Message(_Body):
    """A turn of the conversation: a string, or blocks. `tool_use` blocks belong in assistant turns and
    `tool_result` blocks in user turns, as Anthropic requires."""

    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]

    @model_validator(mode="after")
    def _blocks_of_role(self):
        misplaced = ("tool_result",) if self.role == "assistant" else ("tool_use", "thinking")
        for kind in misplaced:
            if isinstance(self.content, list) and any(b.type == kind for b in self.content):
                raise ValueError(f"{kind} blocks are not allowed in {self.role} messages")
        return self

    def chat_messages(self) -> list[dict]:
        """This turn as chat messages: an assistant turn is one message (its text, then its `tool_use` blocks as
        tool_calls); a user turn is a "tool" message per `tool_result` block, then a user message with its text
        (if any)."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        texts = [b for b in self.content if isinstance(b, TextBlock)]
        if self.role == "assistant":
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
                }
                for b in self.content
                if isinstance(b, ToolUseBlock)
            ]
            thinking = [b.thinking for b in self.content if isinstance(b, ThinkingBlock)]
            return [
                {"role": "assistant", "content": _chat_content(texts) if texts or not calls else None}
                | ({"tool_calls": calls} if calls else {})
                | ({"reasoning_content": "\n".join(thinking)} if thinking else {})
            ]
        results = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": _chat_content(b.content)}
            for b in self.content
            if isinstance(b, ToolResultBlock)
        ]
        return results + ([{"role": "user", "content": _chat_content(texts)}] if texts else [])


class Tool(_Body):
    """A client tool (Anthropic's ToolParam): `input_schema` is the JSON schema of its input, an object.
    Server tools (another `type`: web_search, bash, ...) are refused: nothing here runs them."""

    type: Literal["custom"] = "custom"
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict) -> dict:
        if schema.get("type") != "object":
            raise ValueError('input_schema must have "type": "object" (a tool\'s input is an object)')
        return schema


class ToolChoice(_Body):
    """`tool_choice`: "auto" (the model decides), "any" (some tool must be called), "tool" (the tool `name`
    must be called) or "none" (no tools)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_iff_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name is required with type "tool", and only then')
        return self


class ThinkingConfig(_Body):
    """`thinking` (Anthropic's ThinkingConfigParam): "enabled" lets a reasoning model think for up to
    `budget_tokens` tokens (the think block is then closed for it: engine.sampling_params'
    thinking_token_budget), "disabled" asks the chat template not to open a think block (`enable_thinking`
    false, as Qwen3's reads it). On a server without --reasoning-parser "enabled" is accepted and the reply
    has no thinking blocks: a model that does not reason uses none of the budget."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _budget_iff_enabled(self):
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError('budget_tokens is required with type "enabled", and only then')
        return self


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens: the conversation (`system`, `messages`) and `tools` of a Messages
    request, without its output settings."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] = []
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    chat_template_kwargs: dict | None = None  # vLLM's: extra variables for the chat template

    def chat_request(self, auto_tool_choice: bool) -> ChatCompletionRequest:
        """This request as the chat completion it runs as: `system` first as a system message, then each
        turn's chat messages; the tools as chat functions. tool_choice maps to chat's: "any" to "required"
        (one call at most with `disable_parallel_tool_use`), "tool" to that named function, "none" to no tools
        at all, "auto" (the default) to "auto" on a server with --enable-auto-tool-choice (`auto_tool_choice`),
        else to "none" (the tools are rendered, the output is text). Every field was validated here within
        chat's own constraints, so this does not fail."""
        messages = [{"role": "system", "content": _chat_content(self.system)}] if self.system is not None else []
        for message in self.messages:
            messages += message.chat_messages()
        choice = self.tool_choice or ToolChoice(type="auto")
        if choice.type == "none" or (choice.type == "auto" and not self.tools):
            tools, chat_choice = None, None
        else:
            tools = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in self.tools
            ]
            chat_choice = {
                "auto": "auto" if auto_tool_choice else "none",
                "any": "required",
                "tool": {"type": "function", "function": {"name": choice.name}},
            }[choice.type]
        template_kwargs = self.chat_template_kwargs
        if self.thinking is not None:  # the template opens a think block (or closes an empty one) as asked
            template_kwargs = {"enable_thinking": self.thinking.type == "enabled"} | (template_kwargs or {})
        return ChatCompletionRequest.model_validate(
            {
                "messages": messages,
                "tools": tools or None,
                "tool_choice": chat_choice,
                "parallel_tool_calls": not choice.disable_parallel_tool_use,
                "chat_template_kwargs": template_kwargs,
            }
            | self._output_fields()
        )

    def _output_fields(self) -> dict:
        """The chat request's output settings (sampling, limits), in chat's names: none for counting tokens."""
        return {}


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages (Anthropic's Messages API). `max_tokens` is required; `temperature` defaults to 1.0 as
    Anthropic's does; `top_k` 0 means all tokens. A matched `stop_sequences` entry ends the output (it is not
    part of the text). `metadata` is accepted and ignored."""

    max_tokens: int = Field(ge=1)
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)] = []
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stream: bool = False
    metadata: dict | None = None

    def _output_fields(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
