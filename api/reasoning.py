"""Reasoning output (`--reasoning-parser`, vLLM's names): the text a reasoning model writes between
`<think>` and `</think>` goes to the message's `reasoning_content` (and `reasoning`, vLLM's newer
field), the rest to `content`, whole or streamed delta by delta.

- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the output is reasoning from its
  first token until `</think>` (a `<think>` the model writes itself is dropped); without `</think>`
  it is all reasoning (cut by max_tokens while thinking).
- `qwen3`: reasoning only when the output starts with `<think>` (with `enable_thinking: false` the
  template closes an empty think block in the prompt and the output is all content).
"""

from api.streaming import held_tail

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


class ReasoningParser:
    """Splits one output's text into (reasoning, content) as it streams in: `feed(delta)` returns
    the new reasoning and content text; `finish()` returns what a possible partial tag held back.
    A tag split over several deltas (tokens) is recognised; nothing is lost or repeated.

    Raises ValueError for an unknown parser name.
    """

    def __init__(self, name: str):
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose {', '.join(REASONING_PARSERS)}")
        # deepseek_r1 starts inside the think block; qwen3 decides once it has seen enough text
        self.state = "reasoning" if name == "deepseek_r1" else "undecided"
        self.at_start = True  # a leading <think> is dropped
        self.pending = ""  # text that may be the start of a tag

    def feed(self, delta: str) -> tuple[str, str]:
        text, self.pending = self.pending + delta, ""
        reasoning = content = ""
        while text:
            if self.state == "content":
                return reasoning, content + text
            if self.at_start:
                stripped = text.lstrip()
                if START.startswith(stripped) and len(stripped) < len(START):  # maybe a <think> still coming
                    self.pending = text
                    return reasoning, content
                self.at_start = False
                if stripped.startswith(START):
                    text = stripped[len(START) :]
                    self.state = "reasoning"
                    continue
                if self.state == "undecided":
                    self.state = "content"
                    continue
            end = text.find(END)
            if end >= 0:
                reasoning, text, self.state = reasoning + text[:end], text[end + len(END) :], "content"
                continue
            keep = held_tail(text, END)
            self.pending = text[len(text) - keep :] if keep else ""
            return reasoning + text[: len(text) - keep], content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The text held back at the end, as (reasoning, content)."""
        pending, self.pending = self.pending, ""
        return (pending, "") if self.state == "reasoning" else ("", pending)


def split_delta(parser: ReasoningParser | None, delta: str, finished: bool) -> tuple[str, str]:
    """(reasoning, content) of the next piece of a streamed output: all content without a parser; with the
    text the parser held back once the output is `finished`."""
    if parser is None:
        return "", delta
    reasoning, content = parser.feed(delta)
    if finished:
        tail_reasoning, tail_content = parser.finish()
        reasoning, content = reasoning + tail_reasoning, content + tail_content
    return reasoning, content


def split_reasoning(name: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None when there was none, content) of a whole output."""
    parser = ReasoningParser(name)
    reasoning, content = parser.feed(text)
    tail_reasoning, tail_content = parser.finish()
    reasoning += tail_reasoning
    return (reasoning if parser.state != "undecided" and (reasoning or END in text) else None), content + tail_content
