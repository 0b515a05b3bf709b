"""One sequence's position in its grammar."""

import numpy as np


class RequestGrammar:
    """The grammar state of one sequence (each of n samples has its own), over a shared compiled grammar.

    compiled: the xgrammar `CompiledGrammar`; the `GrammarMatcher` is made on first use. The API is
    what a step needs, and what
    speculative decoding needs to check draft tokens: `accept_tokens` (how many of the given tokens the
    grammar accepts, in order; it advances over those), `rollback(n)` (undo the last n accepted tokens,
    e.g. rejected drafts), `fill_bitmask` (allowed next tokens into a bitmask row) and `is_terminated`
    (a stop token was accepted: nothing may follow).
    """

    def __init__(self, compiled):
        self.compiled = compiled
        self._matcher = None

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar

            self._matcher = xgrammar.GrammarMatcher(self.compiled)
        return self._matcher

    def accept_tokens(self, token_ids: list[int]) -> int:
        """Advances over `token_ids` until the grammar rejects one; returns how many it accepted."""
        m = self.matcher
        for i, token_id in enumerate(token_ids):
            if not m.accept_token(token_id):
                return i
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (a terminated grammar becomes live again)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (int32 [rows, ceil(vocab/32)]; bit j of word
        w allows token 32w + j)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()
