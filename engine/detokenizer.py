"""Incremental detokenization with stop strings, never emitting half a UTF-8 character."""


class IncrementalDetokenizer:
    """Turns a request's output tokens into text one token at a time.

    Offsets method of Hugging Face TGI / vLLM: decode a small window of recent tokens with and without
    the new one; the difference is the new text, unless it ends in U+FFFD (an incomplete UTF-8
    sequence, as with emoji or CJK split over byte tokens), in which case we wait for more tokens.
    The window starts with a few prompt tokens so a first token's leading space decodes right.
    Text that could be the start of a stop string is held back until it is known not to be one.
    """

    CONTEXT = 6  # prompt tokens of left context

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-self.CONTEXT :])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.prefix_text = self._decode(self.ids)
        self.stop, self.include_stop = stop, include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self.stop_string: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_id: int, check_stop: bool) -> None:
        """Adds one token; if `check_stop` and a stop string appears, truncates `text` at it and sets
        `stop_string`."""
        self.ids.append(token_id)
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(self.prefix_text) or new_text.endswith("\ufffd"):
            return
        delta = new_text[len(self.prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        old_len = len(self.text)
        self.text += delta
        if check_stop and self.stop:
            self._find_stop(max(0, old_len - self.max_stop_len + 1))

    def _find_stop(self, start: int) -> None:
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1:
                self.stop_string = s
                self.text = self.text[: idx + len(s) if self.include_stop else idx]
                return

    def output_text(self, finished: bool) -> str:
        """The text safe to show: all of it once finished, else without a tail that could still
        become a stop string."""
        if finished or not self.stop:
            return self.text
        tail = self.text[-(self.max_stop_len - 1) :] if self.max_stop_len > 1 else ""
        for k in range(len(tail), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stop):
                return self.text[:-k]
        return self.text
