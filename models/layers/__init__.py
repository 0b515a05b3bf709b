"""The building blocks the architectures share: tensor-parallel linear layers (`linear.py`), the
vocabulary-parallel embedding and LM head (`vocab_parallel_embedding.py`), RMSNorm (`layernorm.py`) and
rotary embeddings (`rotary_embedding.py`)."""
