"""Finding models: the default GGUF (converted once, cached by content), directories, the local hub cache."""
import os
import time
from pathlib import Path

import pytest

from models.loader import default_model_path, resolve_model


def test_default_gguf_is_converted_once(llm):
    gguf = default_model_path()
    assert gguf.endswith(".gguf") and os.path.exists(gguf)
    start = time.perf_counter()
    assert resolve_model(None) == resolve_model(gguf) == llm.model_dir  # cached: no second conversion
    assert time.perf_counter() - start < 5
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(llm.model_dir))


def test_hub_id_from_the_local_cache(llm, tmp_path, monkeypatch):
    # the Hugging Face cache layout: models--org--name/{refs/main, snapshots/<revision>/...}
    repo = tmp_path / "models--someorg--tiny-smol"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name in os.listdir(llm.model_dir):
        (snapshot / name).symlink_to(Path(llm.model_dir) / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    assert resolve_model("someorg/tiny-smol") == str(snapshot)


def test_missing_models_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        resolve_model("no-such-org/no-such-model")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
