"""Tensor parallelism's process group (`group.py`: gloo on the CPU, NCCL on CUDA): the collectives the
parallel layers call and the per-step broadcast of the step's description. Starting, watching and stopping
the ranks is the engine's (engine/executor)."""
