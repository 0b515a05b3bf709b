"""--reasoning-parser and chat_template_kwargs through the openai, anthropic and ollama SDKs: a chat template that
opens a think block (unless enable_thinking is false) and renders an assistant's past reasoning; output forced by a
regex into thinking + answer, or the model's own tokens with the think block closed by a thinking budget."""

import pytest

from tests.server_harness import ENGINE_ARGS, cli_args

pytest_plugins = ["server_harness"]

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
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


@pytest.mark.slow
async def test_messages_thinking_blocks_within_the_budget(reasoning_server):
    """Anthropic's extended thinking on the model's own tokens: `budget_tokens` closes the think block after that
    many tokens (the answer follows in a text block); a budget past max_tokens leaves it all thinking. Streamed:
    thinking_delta events, a signature_delta before the thinking block stops, then the text block, the same
    content as the whole message. Thinking blocks sent back in history are rendered (counted, templated)."""
    import anthropic
    import httpx

    ask = dict(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "List three colors."}])
    greedy = {"extra_body": {"temperature": 0}}
    async with anthropic.AsyncAnthropic(base_url=reasoning_server.url, api_key="unused", max_retries=0) as client:
        r = await client.messages.create(
            **ask, max_tokens=30, thinking={"type": "enabled", "budget_tokens": 6}, **greedy
        )
        assert [b.type for b in r.content] == ["thinking", "text"] and r.stop_reason == "end_turn"
        thinking, text = r.content[0].thinking, r.content[1].text
        assert thinking.strip() and text.strip() and "</think>" not in thinking + text
        long = await client.messages.create(
            **ask, max_tokens=10, thinking={"type": "enabled", "budget_tokens": 20}, **greedy
        )
        assert [b.type for b in long.content] == ["thinking"] and long.stop_reason == "max_tokens"
        assert long.content[0].thinking.startswith(thinking)  # the same tokens, not cut at 6
        async with client.messages.stream(
            **ask, max_tokens=30, thinking={"type": "enabled", "budget_tokens": 6}, **greedy
        ) as stream:
            raw = ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta")
            events = [e async for e in stream if e.type in raw]  # the SDK adds "text", "thinking", ... events
            final = await stream.get_final_message()
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events]
        assert ("content_block_delta", "thinking_delta") in kinds
        signature = kinds.index(("content_block_delta", "signature_delta"))
        assert kinds[signature + 1] == ("content_block_stop", None) and events[signature + 1].index == 0
        starts = [e for e in events if e.type == "content_block_start"]
        assert [(e.index, e.content_block.type) for e in starts] == [(0, "thinking"), (1, "text")]
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in r.content]
        history = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "A greeting.", "signature": ""},
                                              {"type": "text", "text": "Hello!"}]},
            {"role": "user", "content": "Bye"},
        ]  # fmt: skip
        with_thinking = await client.messages.count_tokens(model=ask["model"], messages=history)
        history[1]["content"] = history[1]["content"][1:]
        without = await client.messages.count_tokens(model=ask["model"], messages=history)
        assert with_thinking.input_tokens > without.input_tokens
    async with httpx.AsyncClient(base_url=reasoning_server.url, timeout=60) as http:
        messages = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
            {"role": "user", "content": "Bye"},
        ]
        prompt = (await http.post("/apply-template", json={"messages": messages})).json()["prompt"]
        assert "<think>A greeting.</think>Hello!" in prompt and prompt.endswith("<|im_start|>assistant\n<think>\n")
        bad = await http.post("/v1/messages", json=ask | {"max_tokens": 5, "thinking": {"type": "enabled"}})
        assert bad.status_code == 400 and "budget_tokens" in bad.json()["error"]["message"]


@pytest.mark.slow
async def test_responses_reasoning_items_whole_and_streamed(reasoning_server):
    """OpenAI's Responses API with --reasoning-parser: a `reasoning` item (its text as reasoning_text content)
    before the message, its tokens in usage; streamed as .reasoning_text.delta events into the same items.
    Reasoning items sent back in `input` are rendered (the prompt grows); `reasoning.effort` "none" asks the
    template for no think block."""
    from openai import AsyncOpenAI

    schema = {"type": "string", "pattern": r"^Two and two make four\.</think>The answer is 4\.$"}
    ask = dict(
        model="SmolLM2-135M-Instruct",
        input="What is 2 + 2?",
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "forced", "schema": schema}},
    )
    async with AsyncOpenAI(base_url=f"{reasoning_server.url}/v1", api_key="unused", max_retries=0) as client:
        r = await client.responses.create(**ask, reasoning={"effort": "medium", "summary": "auto"})
        assert [item.type for item in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == '"Two and two make four.' and r.output[0].summary == []
        assert r.output_text == 'The answer is 4."' and r.reasoning.effort == "medium"
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        deltas, done = [], None
        async with client.responses.stream(**ask) as stream:
            async for event in stream:
                if event.type == "response.reasoning_text.delta":
                    deltas.append(event.delta)
                elif event.type == "response.completed":
                    done = event.response
        assert "".join(deltas) == r.output[0].content[0].text
        assert [i.type for i in done.output] == ["reasoning", "message"] and done.output_text == r.output_text
        turn = [
            {"role": "user", "content": "What is 2 + 2?"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Two and two make four."}]},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3 + 3?"},
        ]  # fmt: skip
        count = {}
        for name, items in (("with", turn), ("without", turn[:1] + turn[2:])):
            count[name] = (await client.responses.create(**ask | {"input": items, "max_output_tokens": 1})).usage
        assert count["with"].input_tokens > count["without"].input_tokens
        plain = await client.responses.create(**ask | {"max_output_tokens": 1}, reasoning={"effort": "none"})
        full = await client.responses.create(**ask | {"max_output_tokens": 1})
        assert 0 < full.usage.input_tokens - plain.usage.input_tokens <= 4
