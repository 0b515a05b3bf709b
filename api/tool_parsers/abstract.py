"""The interface of the tool-call parsers of tool_choice "auto" (vLLM's ToolParser)."""

Call = tuple[str, str]  # (function name, arguments as JSON text: whole, or so far while streaming)


class ToolParser:
    """Reads the tool calls of tool_choice "auto" out of a model's text; one per `--tool-call-parser` name.

    `extract` parses a whole output; `scan` reads one that is still being generated. A text that does not
    parse as the format's calls is content, whole, with no calls.
    """

    # Regular expressions that, found in a chat template, say the model writes this parser's calls (what the
    # server picks the parser by when no --tool-call-parser is given), unless one of TEMPLATE_EXCLUDES is
    # found too (a neighbouring format this parser does not read); no markers: never picked by itself.
    TEMPLATE_MARKERS: tuple[str, ...] = ()
    TEMPLATE_EXCLUDES: tuple[str, ...] = ()

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of a finished output; content None when the output is only calls."""
        raise NotImplementedError

    def scan(self, text: str, finished: bool) -> tuple[str, list[Call]]:
        """(content, calls) that the text so far settles: content that cannot become part of a call and the
        calls begun, each with its arguments so far (the JSON parsers: from when the name is complete, the raw
        text of the arguments; pythonic: a call whole once its text has arrived). What is returned is never
        taken back by a longer text (the content only grows; a call, once returned, keeps its place and its
        arguments only grow, though a half-written one after it may hide it for a while: `ToolCallStream`
        sends only what is past what it sent). Whether a finished text is calls at all is `extract`'s say."""
        if finished:
            content, calls = self.extract(text)
            return content or "", calls
        return self.partial(text)

    def partial(self, text: str) -> tuple[str, list[Call]]:
        """`scan` of an unfinished text."""
        raise NotImplementedError
