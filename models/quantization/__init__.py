"""Quantized weights: what a layer holds and computes with when its checkpoint is not in floating point."""
