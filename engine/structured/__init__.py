"""Structured outputs: output constrained by a JSON schema, regex, choice list or EBNF grammar.

After vLLM v1's structured-output path, with xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models") as the backend:
- `params.py`: what a request asks for (`StructuredOutputsParams`) and the engine's `StructuredOutputsConfig`;
- `manager.py`: the tokenizer's xgrammar vocabulary, one compile cache, compiles on a small thread pool;
- `matcher.py`: one sequence's grammar state (`RequestGrammar`): accept, rollback, fill a bitmask row;
- `bitmask.py`: each step, masks the logits of the constrained rows before sampling.
xgrammar is imported only when a constrained request arrives, so unconstrained serving works without it.
"""
from engine.structured.bitmask import apply_grammar_bitmask
from engine.structured.manager import StructuredOutputManager
from engine.structured.matcher import RequestGrammar
from engine.structured.params import INSTALL_HINT, StructuredOutputsConfig, StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "StructuredOutputsConfig", "StructuredOutputManager", "RequestGrammar",
           "apply_grammar_bitmask", "INSTALL_HINT"]
