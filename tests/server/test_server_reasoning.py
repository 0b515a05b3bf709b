"""--reasoning-parser and chat_template_kwargs through the openai SDK: a chat template that opens a
think block (unless enable_thinking is false), output forced by a regex into thinking + answer."""

import pytest

from tests.server_harness import ENGINE_ARGS, cli_args

pytest_plugins = ["server_harness"]

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}"
)
FORCED = {"structured_outputs": {"regex": r"Two and two make four\.</think>The answer is 4\."}}
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def reasoning_server(server_factory, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(TEMPLATE)
    return server_factory(
        *cli_args(**ENGINE_ARGS), "--reasoning-parser", "deepseek_r1", "--chat-template", str(template)
    )


def extra(obj, name):
    return getattr(obj, name, None) or (obj.model_extra or {}).get(name)


@pytest.mark.slow
async def test_reasoning_is_split_whole_and_streamed(reasoning_server):
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{reasoning_server.url}/v1", api_key="unused", max_retries=0) as client:
        r = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=40, temperature=0, extra_body=FORCED
        )
        message = r.choices[0].message
        assert extra(message, "reasoning_content") == extra(message, "reasoning") == "Two and two make four."
        assert message.content == "The answer is 4."
        reasoning = content = ""
        stream = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=MESSAGES,
            max_tokens=40,
            temperature=0,
            extra_body=FORCED,
            stream=True,
        )
        async for chunk in stream:
            for choice in chunk.choices:
                reasoning += extra(choice.delta, "reasoning_content") or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == ("Two and two make four.", "The answer is 4.")
        # the template's variables: without the think block the prompt is shorter by its tokens
        plain = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=MESSAGES,
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        assert 0 < r.usage.prompt_tokens - plain.usage.prompt_tokens <= 4


@pytest.mark.slow
async def test_chat_template_kwargs_on_messages_and_responses(reasoning_server):
    import httpx

    async with httpx.AsyncClient(base_url=reasoning_server.url, timeout=60) as http:
        counts = []
        for kwargs in (None, {"enable_thinking": False}):
            body = {"model": "SmolLM2-135M-Instruct", "messages": MESSAGES} | (
                {"chat_template_kwargs": kwargs} if kwargs else {}
            )
            counts.append((await http.post("/v1/messages/count_tokens", json=body)).json()["input_tokens"])
            r = await http.post(
                "/v1/responses",
                json={"model": "SmolLM2-135M-Instruct", "input": "What is 2 + 2?", "max_output_tokens": 1}
                | ({"chat_template_kwargs": kwargs} if kwargs else {}),
            )
            counts.append(r.json()["usage"]["input_tokens"])
        assert counts[0] == counts[1] and counts[2] == counts[3] and 0 < counts[0] - counts[2] <= 4


@pytest.mark.slow
async def test_ollama_thinking_whole_and_streamed(reasoning_server):
    """Ollama's `message.thinking`: Ollama has no regex, so a JSON-string schema with a pattern forces the
    think block's end (the answer keeps the string's quotes); `think: false` drops the template's think tag."""
    import ollama

    client = ollama.AsyncClient(host=reasoning_server.url)
    schema = {"type": "string", "pattern": r"^Two and two make four\.</think>The answer is 4\.$"}
    options = {"temperature": 0, "num_predict": 40}
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=MESSAGES, format=schema, options=options)
    r = await client.chat(**kwargs, think=True, stream=False)
    assert (r.message.thinking, r.message.content) == ('"Two and two make four.', 'The answer is 4."')
    parts = [p async for p in await client.chat(**kwargs, think=True, stream=True)]
    assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
    assert "".join(p.message.content for p in parts) == r.message.content
    plain = await client.chat(model="SmolLM2-135M-Instruct", messages=MESSAGES, options={"num_predict": 1}, think=False)
    assert 0 < r.prompt_eval_count - plain.prompt_eval_count <= 4
