"""vLLM's `hermes` tool-call parser."""

import json
import re

from api.streaming import held_tail
from api.tool_parsers.abstract import Call, ToolParser
from api.tool_parsers.json_scan import partial_call, skip_space


class HermesParser(ToolParser):
    """vLLM's `hermes` (Hermes 2 Pro, Qwen 2.5 / 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    blocks; the text before the first one is the content. An unclosed last block is read to the end."""

    # <tool_call> then JSON (Hermes 2 Pro / 3, Qwen 2.5 / 3, Granite 4); not the XML calls of Qwen3-Coder or GLM
    TEMPLATE_MARKERS = (r'<tool_call>[\s\\n"\'+~{}%-]{0,30}\{\\?"(?:name|arguments)\\?"',)

    START, END = "<tool_call>", "</tool_call>"
    BLOCKS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        if self.START not in text:
            return text, []
        try:
            calls = [json.loads(a or b) for a, b in self.BLOCKS.findall(text)]
            calls = [(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False)) for c in calls]
        except (ValueError, TypeError, KeyError):
            return text, []
        return text[: text.index(self.START)] or None, calls

    def scan(self, text: str, finished: bool) -> tuple[str, list[Call]]:
        # block by block, so that (as before this parser had siblings) a block with no name before the first
        # call streams as content and one after it is dropped, rather than the whole output turning into content
        content, calls, pos = "", [], 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                # after the first call, text outside calls is not content (as in `extract`)
                if not calls:
                    content += text[pos : len(text) - (0 if finished else held_tail(text[pos:], self.START))]
                return content, calls
            if not calls:
                content += text[pos:start]
            end = text.find(self.END, start)
            # an unclosed block ends where the text does, less what may be the start of its closing tag
            body_end = end if end >= 0 else len(text) - (0 if finished else held_tail(text, self.END))
            body = skip_space(text, start + len(self.START))
            name, arguments, object_end = (
                partial_call(text[:body_end], body, ("arguments",))
                if text.startswith("{", body)
                else (None, None, None)
            )
            if name is not None:  # no "arguments" is {} (as in `extract`), once the object shows there are none
                calls.append((name, arguments if arguments is not None else "" if object_end is None else "{}"))
            if end < 0:
                return content, calls
            pos = end + len(self.END)
            if name is None and not calls:
                content += text[start:pos]
