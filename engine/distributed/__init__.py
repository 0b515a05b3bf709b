"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, as vLLM does it) over torch.distributed.

- `group.py`: one engine's process group (gloo on CPU, NCCL on CUDA), its collectives and the per-step
  broadcast of the model inputs from rank 0 to the other ranks.
- `layers.py`: column-/row-parallel linear layers and the vocabulary-parallel embedding / LM head, with
  the weight loaders that keep each rank's shard of a checkpoint tensor.
- `launcher.py`: rank 0 (the engine's process) starting, watching and stopping the other ranks.
- `worker.py`: the loop of a rank other than 0: receive a step's inputs, run the model shard.

Kept free of imports here: models/llama.py imports `layers`, and `launcher` imports the model runner.
"""
