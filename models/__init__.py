"""The model executor: what runs a model on one device, below the engine that decides what runs.

- the architectures, one file each (`llama.py`), found by `registry.get_model_class`;
- their building blocks (`layers/`: parallel linear layers, the vocabulary-parallel embedding, norms,
  rotary embeddings), attention backends (`attention/`), quantization methods (`quantization/`), the
  C kernels they call (`kernels/`) and the tensor-parallel process group (`distributed/`);
- reading checkpoints (`loader.py`, `gguf.py`) and the per-rank shape (`config.py`).

Nothing here imports `engine` or `api`. Importing the package itself imports nothing (a light module such
as `models.cache_dir` stays light).
"""
