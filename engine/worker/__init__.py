"""What runs on a device: the model runner (model, KV cache, a step's forward), input preparation,
CUDA graphs and the host memory the CPU KV cache lives in."""
