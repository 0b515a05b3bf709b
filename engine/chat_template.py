"""A conversation to prompt token ids through the model's chat template (LLM.chat and the server's
chat endpoints)."""


def encode_chat(
    tokenizer,
    conversation: list[dict],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    add_special_tokens: bool = False,
    **template_kwargs,
) -> list[int]:
    """Token ids of `conversation` ({"role", "content", ...} dicts, and the tool definitions for templates
    that render them) rendered by `chat_template` (Jinja source) or the tokenizer's own, with
    `template_kwargs` as extra template variables (vLLM's chat_template_kwargs).

    The template already holds the special tokens, so by default encoding adds no BOS again.
    Raises what rendering raises: jinja2.TemplateError, ValueError (no template), TypeError.
    """
    text = tokenizer.apply_chat_template(
        conversation,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        tools=tools,
        **template_kwargs,
    )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
