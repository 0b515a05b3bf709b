"""Everything that turns logits into tokens: logit processing and draws (sampler), the step's
sampler with draft verification (rejection_sampler), grammar masks (bitmask), prompt logprobs."""
