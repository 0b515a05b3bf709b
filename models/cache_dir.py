"""Where built kernels and converted models are kept between runs: $MINIVLLM_CACHE, else ~/.cache/minivllm."""

import os
from pathlib import Path

CACHE_DIR = Path(os.environ.get("MINIVLLM_CACHE", Path.home() / ".cache" / "minivllm"))
