"""Each step: the logits of grammar-constrained rows masked to the tokens their grammars allow."""
import numpy as np
import torch


def apply_grammar_bitmask(logits: torch.Tensor, requests: list) -> None:
    """Sets to -inf, in place, every token the row's grammar does not allow next; rows of requests without
    a grammar (`request.grammar is None`) are untouched and cost one attribute check each.

    logits: float [N, vocab] on the CPU, row i for requests[i]. Runs before every sampling transform, so
    greedy and random rows alike (and logprobs) see the masked logits, as in vLLM.
    """
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    bitmask = np.empty((len(rows), -(-vocab // 32)), dtype=np.int32)
    for k, i in enumerate(rows):
        requests[i].grammar.fill_bitmask(bitmask, k)
    # Bit j of word w is token 32w + j: on a little-endian machine the words' bytes in memory, unpacked
    # little-bit first, are the tokens in order. NumPy + one masked_fill over the rows is several times
    # faster on the CPU than xgrammar's single-threaded kernel at 64 rows.
    banned = np.unpackbits(np.invert(bitmask).view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    banned = torch.from_numpy(banned.view(np.bool_))
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(banned, float("-inf"))
    else:
        index = torch.tensor(rows)
        logits[index] = logits[index].masked_fill_(banned, float("-inf"))
