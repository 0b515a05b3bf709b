"""Structured outputs at sampling time: logits masked to the tokens each row's grammar allows next."""

import numpy as np
import torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """Sets to -inf, in place, every token that row `rows[k]` of `logits` may not take next.

    logits: float [N, vocab] on the CPU; bitmask: int32 [len(rows), ceil(vocab / 32)], bit j of word w
    allowing token 32w + j (xgrammar's layout, filled by engine.structured). Runs before every
    sampling transform, so greedy and random rows alike (and logprobs) see the masked logits, as in vLLM.
    """
    vocab = logits.shape[1]
    # On a little-endian machine the words' bytes in memory, unpacked little-bit first, are the tokens
    # in order. NumPy + one masked_fill over the rows is several times faster on the CPU than
    # xgrammar's single-threaded kernel at 64 rows.
    banned = np.unpackbits(np.invert(bitmask).view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    banned = torch.from_numpy(banned.view(np.bool_))
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(banned, float("-inf"))
    else:
        index = torch.tensor(rows)
        logits[index] = logits[index].masked_fill_(banned, float("-inf"))
