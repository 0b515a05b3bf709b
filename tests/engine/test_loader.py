"""Finding models: the default GGUF (read directly, no conversion), directories, the local hub cache."""

import os
from pathlib import Path

import pytest

from models.loader import default_model_path, export_hf_directory, resolve_model


def test_default_gguf_is_read_as_it_is(llm):
    gguf = default_model_path()
    assert gguf.endswith(".gguf") and os.path.exists(gguf)
    assert resolve_model(None) == resolve_model(gguf) == llm.model_dir == gguf  # nothing converted


def test_hub_id_from_the_local_cache(hf_model_dir, tmp_path, monkeypatch):
    # the Hugging Face cache layout: models--org--name/{refs/main, snapshots/<revision>/...}
    repo = tmp_path / "models--someorg--tiny-smol"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name in os.listdir(hf_model_dir):
        (snapshot / name).symlink_to(Path(hf_model_dir) / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    assert resolve_model("someorg/tiny-smol") == str(snapshot)
    assert export_hf_directory(str(snapshot)) == str(snapshot)  # already a directory


def test_missing_models_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        resolve_model("no-such-org/no-such-model")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
