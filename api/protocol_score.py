"""Request bodies of the scoring routes: Jina's / Cohere's rerank and vLLM's /score (api.serving_score)."""

from typing import Annotated

from pydantic import Field, model_validator

from api.protocol import _Body

MAX_DOCUMENTS = 1000


class RerankDocument(_Body):
    """A document given as an object (Cohere's `{"text": ...}`)."""

    text: str


class RerankRequest(_Body):
    """POST /v1/rerank: `documents` are strings or `{"text"}` objects; `top_n` keeps the best N."""

    model: str | None = None
    query: str
    documents: Annotated[list[str | RerankDocument], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    max_tokens_per_doc: int | None = None  # Cohere v2's truncation of each document: refused, not ignored

    @model_validator(mode="after")
    def _no_truncation(self):
        if self.max_tokens_per_doc is not None:
            raise ValueError("max_tokens_per_doc is not supported: documents are scored whole (too long gets 400)")
        return self

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_Body):
    """POST /score (vLLM's): `text_1` one string (scored against every `text_2`) or a list as long as `text_2`."""

    model: str | None = None
    text_1: str | Annotated[list[str], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    text_2: str | Annotated[list[str], Field(min_length=1, max_length=MAX_DOCUMENTS)]

    @model_validator(mode="after")
    def _pairs_up(self):
        if isinstance(self.text_1, list) and len(self.text_1) > 1:
            n2 = len(self.text_2) if isinstance(self.text_2, list) else 1
            if n2 != len(self.text_1):
                raise ValueError(f"text_1 has {len(self.text_1)} texts and text_2 {n2}: give one text_1 or as many")
        return self

    def pairs(self) -> list[tuple[str, str]]:
        """(query, document) pairs, in `text_2`'s order."""
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        return list(zip(first if len(first) == len(second) else first * len(second), second))
