"""Speculative decoding: n-gram prompt lookup or a draft model proposes, the target verifies a whole
draft in one step, and rejection sampling (engine.sample.rejection_sampler) keeps the output
distribution exactly the target's. Its settings are `engine.config.SpeculativeConfig`."""
