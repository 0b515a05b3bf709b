"""The reasoning parsers on real token streams: a reasoning model's output as the default model's
tokenizer cuts it, fed token by token (and cut at every character), equals the whole-text split."""

import pytest

from api.reasoning import ReasoningParser, split_reasoning
from models.loader import load_tokenizer, resolve_model

THINKING = "<think>\nThe user asks for 2 + 2. That is 4; no tools needed.\n</think>\n\nThe answer is **4**."
CASES = [  # (parser, output, reasoning, content)
    ("deepseek_r1", THINKING, "\nThe user asks for 2 + 2. That is 4; no tools needed.\n", "\n\nThe answer is **4**."),
    (
        "deepseek_r1",
        THINKING.removeprefix("<think>"),
        "\nThe user asks for 2 + 2. That is 4; no tools needed.\n",
        "\n\nThe answer is **4**.",
    ),  # the template opened the block
    ("deepseek_r1", "Still thinking when max_tokens cut it", "Still thinking when max_tokens cut it", ""),
    ("qwen3", THINKING, "\nThe user asks for 2 + 2. That is 4; no tools needed.\n", "\n\nThe answer is **4**."),
    ("qwen3", "The answer is 4 (thinking disabled).", None, "The answer is 4 (thinking disabled)."),
    ("qwen3", "<thin", None, "<thin"),  # looked like a tag, was not
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


def stream(parser: ReasoningParser, deltas) -> tuple[str, str]:
    reasoning = content = ""
    for delta in deltas:
        r, c = parser.feed(delta)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("name, output, reasoning, content", CASES)
def test_whole_and_streamed_token_by_token(tokenizer, name, output, reasoning, content):
    assert split_reasoning(name, output) == (reasoning, content)
    ids = tokenizer.encode(output, add_special_tokens=False)
    texts = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    assert texts[-1] == output
    deltas = [b[len(a) :] for a, b in zip(texts, texts[1:])]
    assert stream(ReasoningParser(name), deltas) == (reasoning or "", content)


@pytest.mark.parametrize("name, output, reasoning, content", CASES)
def test_every_cut_into_two_deltas(name, output, reasoning, content):
    for cut in range(len(output) + 1):
        assert stream(ReasoningParser(name), [output[:cut], output[cut:]]) == (reasoning or "", content), cut


def test_unknown_parser():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningParser("granite")
