"""The tool-call parser picked from a chat template when no --tool-call-parser is given, on the real templates
of llama.cpp's tree (models/templates, HF models' own, fetched by `make install`): JSON-in-<tool_call> is
hermes, Llama 3.x's "parameters" JSON is llama3_json, [TOOL_CALLS] + JSON array is mistral; XML-style calls,
Mistral's newer [ARGS] and templates without tools get none (today's 400 for tool_choice "auto")."""

import pytest

from api.app import with_detected_tool_parser
from api.settings import ServerSettings
from api.tool_parsers import detect_tool_parser
from scripts import llama_cpp

TEMPLATES = llama_cpp.SOURCE / "models" / "templates"
EXPECTED = {
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "Qwen-Qwen3-0.6B": "hermes",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes",
    "ibm-granite-granite-4.0": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3_json",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3_json",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3_json",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": None,  # [TOOL_CALLS]name[ARGS]{...}: not read here
    "Qwen3-Coder": None,  # <tool_call><function=...> XML
    "GLM-4.6": None,  # <tool_call>name<arg_key>...
    "google-gemma-2-2b-it": None,  # no tools
    "microsoft-Phi-3.5-mini-instruct": None,
}


@pytest.mark.parametrize("name, parser", EXPECTED.items())
def test_parser_from_real_templates(name, parser):
    path = TEMPLATES / f"{name}.jinja"
    if not path.exists():
        pytest.skip("llama.cpp's tree is fetched by `make install` (python scripts/llama_cpp.py fetch)")
    assert detect_tool_parser(path.read_text()) == parser


def test_pythonic_and_no_template():
    assert detect_tool_parser("... in the format [func_name1(params_name1=params_value1), func_name2(params)]") == (
        "pythonic"
    )
    assert detect_tool_parser(None) is None and detect_tool_parser("") is None


def test_an_explicit_parser_wins_and_none_stays_off():
    hermes = '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
    auto = with_detected_tool_parser(ServerSettings(), hermes)
    assert (auto.enable_auto_tool_choice, auto.tool_call_parser) == (True, "hermes")
    given = with_detected_tool_parser(ServerSettings(tool_call_parser="mistral"), hermes)
    assert (given.enable_auto_tool_choice, given.tool_call_parser) == (False, "mistral")
    plain = with_detected_tool_parser(ServerSettings(), "{{ messages }}")
    assert (plain.enable_auto_tool_choice, plain.tool_call_parser) == (False, None)
