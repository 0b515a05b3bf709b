"""Request bodies of Ollama's API (github.com/ollama/ollama, docs/api.md), as the `ollama` Python client and
LangChain's `ChatOllama` send them. A chat or generate request runs as the chat completion it amounts to
(`chat_request`), so the chat template, sampling, tools and structured outputs are those of
/v1/chat/completions.

`options` are Ollama's model parameters: the sampling ones map to vLLM's sampling params (num_predict to
max_tokens, repeat_penalty to repetition_penalty, ...); those of llama.cpp's runner that do not change the
output (num_gpu, num_thread, num_batch, use_mmap, ...) are accepted; sampling methods this engine does not
have (mirostat, tfs_z, typical_p, a repeat penalty over only the last N tokens) are refused unless they are at
their neutral value; options Ollama itself does not know are ignored, as Ollama ignores them.
"""

import json
import logging
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from api.protocol import ChatCompletionRequest, _Body

logger = logging.getLogger("api")

# llama.cpp runner settings Ollama takes in `options`: where and how the model runs, not what it outputs
RUNNER_OPTIONS = {
    "num_keep",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "f16_kv",
    "logits_all",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "num_thread",
    "numa",
}
# sampling methods this engine does not run, each with its neutral value (accepted; any other is refused)
NEUTRAL_OPTIONS = {"mirostat": 0, "mirostat_tau": None, "mirostat_eta": None, "tfs_z": 1.0, "typical_p": 1.0}


class Options(_Body):
    """Ollama's `options` (its Modelfile parameters). Raises (a 400 naming the option) for a sampling method
    that is not run here at a non-neutral value, and for num_predict 0 or below -2."""

    model_config = ConfigDict(extra="allow")  # Ollama ignores options it does not know; so does this

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    num_predict: int | None = None
    num_ctx: int | None = Field(None, ge=1)
    stop: list[str] | None = None
    repeat_penalty: float | None = Field(None, gt=0)
    repeat_last_n: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    penalize_newline: bool | None = None  # accepted: Ollama's runner no longer applies it (llama.cpp dropped it)

    @model_validator(mode="after")
    def _supported(self):
        extra = self.model_extra or {}
        for name, neutral in NEUTRAL_OPTIONS.items():
            value = extra.get(name)
            if (
                value is not None
                and value != neutral
                and not (name.startswith("mirostat_") and not extra.get("mirostat"))
            ):
                raise ValueError(f"option {name} {value!r} is not supported (this engine has no {name} sampling)")
        penalized = self.repeat_penalty not in (None, 1.0)
        if penalized and self.repeat_last_n not in (None, -1):
            raise ValueError(
                f"option repeat_last_n {self.repeat_last_n} is not supported: repeat_penalty applies to the whole "
                f"context here (repeat_last_n -1)"
            )
        if self.num_predict is not None and (self.num_predict == 0 or self.num_predict < -2):
            raise ValueError("option num_predict must be positive, or -1 (no limit) or -2 (fill the context)")
        unknown = set(extra) - RUNNER_OPTIONS - set(NEUTRAL_OPTIONS)
        if unknown:
            logger.warning("ignoring Ollama options this server does not know: %s", ", ".join(sorted(unknown)))
        return self

    def sampling_fields(self) -> dict:
        """The chat request's sampling fields (vLLM's names) for the options that were set."""
        fields = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": None if self.top_k is None else (self.top_k if self.top_k > 0 else -1),
            "min_p": self.min_p,
            "seed": self.seed,
            "max_tokens": self.num_predict if self.num_predict and self.num_predict > 0 else None,
            "stop": self.stop,
            "repetition_penalty": self.repeat_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        return {k: v for k, v in fields.items() if v is not None}


class OllamaToolCall(_Body):
    """A call in an assistant message of the history: `function.arguments` is an object."""

    model_config = ConfigDict(extra="ignore")

    class Function(_Body):
        model_config = ConfigDict(extra="ignore")
        name: str
        arguments: dict[str, Any] = {}

    function: Function


class OllamaMessage(_Body):
    """A message of /api/chat: a "tool" message answers a call (named by `tool_name`, else the next one)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None


class _Generating(_Body):
    """Fields /api/chat and /api/generate share."""

    model: str | None = None
    format: Literal["json", ""] | dict | None = None
    options: Options | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: str | int | float | None = None  # models stay loaded here; accepted
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool = False

    @model_validator(mode="after")
    def _no_logprobs(self):
        if self.logprobs:
            raise ValueError("logprobs is not supported on Ollama's routes here (/v1/chat/completions has them)")
        return self

    def _output_fields(self) -> dict:
        """Sampling and output-format fields of the chat request."""
        fields = self.options.sampling_fields() if self.options else {}
        if self.format == "json":
            fields["response_format"] = {"type": "json_object"}
        elif isinstance(self.format, dict):
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "format", "schema": self.format},
            }
        return fields

    def _template_kwargs(self) -> dict | None:
        # think false: templates of thinking models (Qwen3's) take enable_thinking
        return {"enable_thinking": False} if self.think is False else None


class OllamaChatRequest(_Generating):
    """POST /api/chat."""

    messages: list[OllamaMessage] = []
    tools: list[dict] | None = None

    def chat_request(self, auto_tool_choice: bool) -> ChatCompletionRequest:
        """The chat completion this request runs as. Tool calls of the history get ids, and each tool message
        answers the pending call of its `tool_name` (else the first pending one). With tools the choice is
        "auto" on a server with --enable-auto-tool-choice, else the chat route's 400 names the flags.
        Raises pydantic's ValidationError (a 400) for what chat refuses."""
        messages, pending = [], []
        for i, m in enumerate(self.messages):
            if m.role == "tool":
                match = next((c for c in pending if c[1] == m.tool_name), pending[0] if pending else None)
                if match:
                    pending.remove(match)
                messages.append(
                    {"role": "tool", "content": m.content, "tool_call_id": match[0] if match else f"call_{i}_none"}
                )
                continue
            message = {"role": m.role, "content": m.content}
            if m.tool_calls:
                calls = [
                    {
                        "id": f"call_{i}_{k}",
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)},
                    }
                    for k, c in enumerate(m.tool_calls)
                ]
                message["tool_calls"], pending = calls, [(c["id"], c["function"]["name"]) for c in calls]
            messages.append(message)
        return ChatCompletionRequest.model_validate(
            {
                "messages": messages,
                "tools": self.tools or None,
                "tool_choice": ("auto" if auto_tool_choice else None) if self.tools else None,
                "chat_template_kwargs": self._template_kwargs(),
            }
            | self._output_fields()
        )


class OllamaGenerateRequest(_Generating):
    """POST /api/generate: `prompt` (with `system`) through the chat template, unless `raw`; `context` (the
    token ids a previous response returned) goes before it. An empty prompt only loads the model."""

    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion whose template renders the prompt (its messages; unused when `raw`)."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return ChatCompletionRequest.model_validate(
            {
                "messages": messages + [{"role": "user", "content": self.prompt}],
                "chat_template_kwargs": self._template_kwargs(),
            }
            | self._output_fields()
        )


class OllamaEmbedRequest(_Body):
    """POST /api/embed: one embedding per input; `truncate` (default true) cuts inputs to the context."""

    model: str | None = None
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    options: Options | None = None
    keep_alive: str | int | float | None = None


class OllamaEmbeddingsRequest(_Body):
    """POST /api/embeddings (Ollama's older route): one `prompt`, answered `{"embedding": [...]}`."""

    model: str | None = None
    prompt: str
    options: Options | None = None
    keep_alive: str | int | float | None = None


class OllamaShowRequest(_Body):
    """POST /api/show (`name` is the older spelling of `model`)."""

    model: str | None = None
    name: str | None = None
    verbose: bool = False
