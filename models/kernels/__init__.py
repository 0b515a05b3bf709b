"""The CPU kernels: C sources in csrc/, built and loaded by cpu_kernels.py, and the tensor ops the
model calls (ops.py), each with a torch fallback."""
