"""Speculative decoding: n-gram prompt lookup or a draft model proposes, the target verifies a whole
draft in one step, and rejection sampling keeps the output distribution exactly the target's."""
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.metrics import SpecDecodingStats

__all__ = ["SpeculativeConfig", "SpecDecodingStats"]
