"""Log-probabilities in OpenAI's two wire shapes: the completions API's parallel lists and the chat
API's per-token objects. Token strings are each token decoded on its own; a logprob of -inf (a token
the model rules out) is sent as -9999.0, as vLLM does, because JSON has no infinity."""

from typing import Callable

from engine import Logprob

_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, _FLOOR)


class CompletionLogprobs:
    """Builds `choices[i].logprobs` of /v1/completions: tokens, token_logprobs, top_logprobs and
    text_offset (each token's character offset in the choice's text, which starts with the prompt
    when echo is on). Keeps the running offset so a stream's chunks continue each other."""

    def __init__(self, token_text: Callable[[int], str]):
        self._token_text = token_text
        self._offset = 0

    def prompt(self, token_ids: list[int], prompt_logprobs: list[Logprob | None] | None) -> dict:
        """Entries for echoed prompt tokens from the engine's prompt logprobs (the first token's are
        null, as OpenAI sends them; all are null if the engine computed none)."""
        tokens = [self._token_text(t) for t in token_ids]
        entries = prompt_logprobs or [None] * len(tokens)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp.logprob) if lp else None for lp in entries],
            "top_logprobs": [self._top(lp, token) if lp else None for lp, token in zip(entries, tokens)],
            "text_offset": self._offsets(tokens),
        }

    def generated(self, logprobs: list[Logprob]) -> dict:
        """Entries for generated tokens; top_logprobs maps token text to logprob for the requested
        top N plus the sampled token (so up to N + 1 entries, as in OpenAI's API)."""
        tokens = [self._token_text(lp.token_id) for lp in logprobs]
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [self._top(lp, token) for lp, token in zip(logprobs, tokens)],
            "text_offset": self._offsets(tokens),
        }

    def _top(self, lp: Logprob, token: str) -> dict[str, float]:
        top = {self._token_text(t): _finite(v) for t, v in lp.top_logprobs}
        top.setdefault(token, _finite(lp.logprob))
        return top

    def _offsets(self, tokens: list[str]) -> list[int]:
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return offsets


def merge(first: dict, second: dict) -> dict:
    """Two completions logprobs objects, one after the other (echoed prompt, then generated)."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(logprobs: list[Logprob], token_text: Callable[[int], str]) -> dict:
    """`choices[i].logprobs` of /v1/chat/completions: {"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}, top_logprobs holding exactly the requested top N."""

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return {
        "content": [
            entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top_logprobs]}
            for lp in logprobs
        ]
    }


def vllm_prompt_logprobs(prompt_logprobs: list[Logprob | None], token_text: Callable[[int], str]) -> list:
    """vLLM's `prompt_logprobs` response field: per prompt token None (the first) or {token id (as a
    JSON key string): {"logprob", "rank", "decoded_token"}} holding the prompt token and the top-k."""

    def entry(lp: Logprob) -> dict:
        out = {
            str(t): {"logprob": _finite(v), "rank": rank, "decoded_token": token_text(t)}
            for rank, (t, v) in enumerate(lp.top_logprobs, start=1)
        }
        out.setdefault(
            str(lp.token_id),
            {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": token_text(lp.token_id)},
        )
        return out

    return [entry(lp) if lp else None for lp in prompt_logprobs]
