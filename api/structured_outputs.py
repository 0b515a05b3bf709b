"""The request fields that constrain the output (OpenAI's `response_format`, vLLM's `structured_outputs` and its
older `guided_*` names) turned into the engine's `StructuredOutputsParams`."""

from api.errors import APIError
from api.protocol import SamplingRequest
from engine import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_params(req: SamplingRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the request field it came from), or (None, None) for an unconstrained request.

    `response_format` json_object / json_schema (its `strict` is always enforced), `structured_outputs`
    ({json | regex | choice | grammar | json_object, disable_any_whitespace}), or one `guided_*` field.

    Raises:
        APIError: 400 naming the field, for several of these at once or an invalid constraint (none or
            several kinds, an empty choice); grammars are compiled later (`ServingContext.compile`).
    """
    found = []
    if req.response_format is not None and req.response_format.type != "text":
        fmt = req.response_format
        kwargs = {"json_object": True} if fmt.type == "json_object" else {"json": fmt.json_schema.json_schema}
        found.append(("response_format", kwargs))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        found.append(
            (
                "structured_outputs",
                {
                    "json": so.json_schema,
                    "regex": so.regex,
                    "choice": so.choice,
                    "grammar": so.grammar,
                    "json_object": so.json_object,
                    "disable_any_whitespace": so.disable_any_whitespace,
                },
            )
        )
    found += [(name, {kind: getattr(req, name)}) for name, kind in _GUIDED.items() if getattr(req, name) is not None]
    if not found:
        return None, None
    if len(found) > 1:
        names = [name for name, _ in found]
        raise APIError(400, f"give only one output constraint; got {', '.join(names)}", param=names[1])
    param, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs), param
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None
