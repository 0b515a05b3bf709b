"""The tool-call parsers of tool_choice "auto", one file each, by their `--tool-call-parser` names (vLLM's):
hermes, llama3_json, pythonic, mistral. `TOOL_CALL_PARSERS` lists the names; `get_tool_parser` gives one."""

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

__all__ = ["Call", "TOOL_CALL_PARSERS", "ToolParser", "get_tool_parser"]


def get_tool_parser(name: str) -> ToolParser:
    """The parser named `name` (one of TOOL_CALL_PARSERS). Raises KeyError for another name."""
    return _PARSERS[name]()
