"""Structured outputs: output constrained by a JSON schema, regex, choice list or EBNF grammar.

After vLLM v1's structured-output path, with xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models") as the backend. What a request asks for is
`engine.sampling_params.StructuredOutputsParams`, the engine's options `engine.config.StructuredOutputsConfig`.
- `manager.py`: the tokenizer's xgrammar vocabulary, one compile cache, compiles on a small thread pool, and
  the step's hook: the bitmask of the next tokens each constrained request may take;
- `matcher.py`: one sequence's grammar state (`RequestGrammar`): accept, rollback, fill a bitmask row.
The mask is applied to the logits at sampling time (engine.sample.bitmask). xgrammar is imported only when
a constrained request arrives, so unconstrained serving works without it.
"""
