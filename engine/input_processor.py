"""Everything a request goes through before the engine core (vLLM v1's InputProcessor): validation,
tokenization, structured-output compilation and the fan-out of n > 1 into n scheduler requests."""

import dataclasses
import time

from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.structured.manager import StructuredOutputManager
from engine.structured.matcher import RequestGrammar


class InputProcessor:
    """Turns a prompt and its SamplingParams into the engine core's `Request`s.

    vocab_size: the logits' width; max_model_len: tokens per sequence; eos_token_ids: the engine's EOS ids;
    structured: the compile side of structured outputs; kv_connector: checks kv_transfer_params
    (engine.kv_transfer); pooling_type: what an embedding request pools (--pooler-config).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        structured: StructuredOutputManager,
        kv_connector,
        pooling_type: str,
    ):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.eos_token_ids, self.structured, self.kv_connector = eos_token_ids, structured, kv_connector
        self.pooling_type = pooling_type

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (a string is encoded with the tokenizer's special tokens, as HF does).

        Raises ValueError for an empty prompt, ids outside the vocabulary, or a prompt that leaves no
        room for one output token within max_model_len.
        """
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens; max_model_len is {self.max_model_len} (prompt + at least 1 output token)"
            )
        return ids

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
        pooling: bool = False,
    ) -> tuple[list[int], list[Request]]:
        """The prompt's token ids and the request's samples as scheduler Requests: one, or for n > 1 n of
        them (ids "<request_id>#<i>"), each with its own params: n 1, the seed offset by its index (so the
        samples of a seeded request differ and each stays reproducible), prompt logprobs asked of the first
        alone. `prompt_token_ids`: the prompt already tokenized by `tokenize`. `pooling`: an embedding
        request (prompt only).

        Raises ValueError for bad input, including a structured-outputs constraint that does not compile
        (this waits for its compile, compile_timeout seconds at most).
        """
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
            if any(t >= self.vocab_size for t in ids):
                raise ValueError(f"{name} token ids must be below the vocabulary size {self.vocab_size}")
        if pooling and (params.max_tokens != 0 or params.n != 1):
            raise ValueError("an embedding request computes its prompt alone: max_tokens 0 and n 1")
        ids = prompt_token_ids or self.tokenize(prompt)
        self.kv_connector.check_request((params.extra_args or {}).get("kv_transfer_params"), len(ids), params.n)
        compiled = (
            self.structured.compile_and_wait([params.structured_outputs])[0] if params.structured_outputs else None
        )
        arrival = arrival_time or time.monotonic()
        requests = []
        for i in range(params.n):
            child = (
                params
                if params.n == 1
                else dataclasses.replace(
                    params,
                    n=1,
                    seed=None if params.seed is None else params.seed + i,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                )
            )
            requests.append(
                Request(
                    request_id if params.n == 1 else f"{request_id}#{i}",
                    ids,
                    child,
                    self.eos_token_ids,
                    arrival,
                    RequestGrammar(compiled) if compiled else None,
                    self.pooling_type if pooling else None,
                )
            )
        return ids, requests
