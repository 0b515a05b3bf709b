"""The tool-call parsers of tool_choice "auto", one file each, by their `--tool-call-parser` names (vLLM's):
hermes, llama3_json, pythonic, mistral. `TOOL_CALL_PARSERS` lists the names; `get_tool_parser` gives one;
`detect_tool_parser` names the one a chat template's tool format calls for."""

import re

from api.tool_parsers.abstract import Call, ToolParser
from api.tool_parsers.hermes import HermesParser
from api.tool_parsers.llama3_json import Llama3JsonParser
from api.tool_parsers.mistral import MistralParser
from api.tool_parsers.pythonic import PythonicParser

_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
    "mistral": MistralParser,
}
TOOL_CALL_PARSERS = tuple(_PARSERS)

__all__ = ["Call", "TOOL_CALL_PARSERS", "ToolParser", "detect_tool_parser", "get_tool_parser"]


def get_tool_parser(name: str) -> ToolParser:
    """The parser named `name` (one of TOOL_CALL_PARSERS). Raises KeyError for another name."""
    return _PARSERS[name]()


def detect_tool_parser(template: str | None) -> str | None:
    """The parser whose calls a chat template asks the model for, by the parsers' TEMPLATE_MARKERS and
    TEMPLATE_EXCLUDES (checked in the order mistral, hermes, pythonic, llama3_json); None for a template with no
    tool format these parsers read (XML-style calls, Mistral's [ARGS], Command R's ...), or no template."""
    if not template:
        return None
    for name in ("mistral", "hermes", "pythonic", "llama3_json"):
        parser = _PARSERS[name]
        found = any(re.search(marker, template) for marker in parser.TEMPLATE_MARKERS)
        if found and not any(re.search(exclude, template) for exclude in parser.TEMPLATE_EXCLUDES):
            return name
    return None
