"""`server.py --models-dir DIR --models-max 1`: two models of one directory answer alternately through the real
OpenAI and Ollama clients, each loaded on first use and the other unloaded (its process gone, its memory back),
llama-server's /models/load and /models/unload, an unknown model a 404."""

import os
import shutil

import httpx
import ollama
import openai
import pytest

from api.memory_report import resident_bytes
from models.loader import resolve_model
from scripts.server_process import ServerProcess

pytestmark = pytest.mark.slow


def children_rss(pid: int) -> dict[int, int]:
    """pid -> resident bytes of `pid`'s child processes (Linux /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out[int(entry)] = resident_bytes(int(entry))
    return out


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    gguf = resolve_model(None)
    for name in ("alpha", "beta"):  # two names for the default model's file: two models, two processes
        os.symlink(gguf, models / f"{name}.gguf")
    (models / "notes.txt").write_text("not a model")
    proc = ServerProcess(
        ["--models-dir", str(models), "--models-max", "1", "--dtype", "float32", "--kv-cache-memory", "256M"],
        timeout=60,
    )
    yield proc
    log = proc.log()
    assert proc.stop() == 0, log[-4000:]
    assert not children_rss(proc.proc.pid)  # no model process outlives the router
    shutil.rmtree(models)


def loaded(url: str) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in httpx.get(f"{url}/v1/models").json()["data"]}


def test_two_models_alternate_with_one_loaded(router):
    assert loaded(router.url) == {"alpha": "unloaded", "beta": "unloaded"}  # notes.txt is no model
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=300)
    texts = {}
    for name in ("alpha", "beta", "alpha"):
        out = client.completions.create(model=name, prompt="The capital of France is", max_tokens=4, temperature=0)
        assert out.model == name
        texts.setdefault(name, out.choices[0].text)
        assert out.choices[0].text == texts[name]
        assert loaded(router.url) == {name: "loaded", "beta" if name == "alpha" else "alpha": "unloaded"}
        assert len(children_rss(router.proc.pid)) == 1
    assert texts["alpha"] == texts["beta"]  # the same file under two names
    stream = client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "Say hi"}], max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gamma", prompt="x", max_tokens=1)


def test_ollama_client_and_load_unload(router):
    client = ollama.Client(host=router.url, timeout=300)
    assert sorted(m.model for m in client.list().models) == ["alpha", "beta"]
    reply = client.chat(
        model="alpha:latest", messages=[{"role": "user", "content": "Say hi"}], options={"num_predict": 4}
    )
    assert reply.message.content
    before = children_rss(router.proc.pid)
    assert len(before) == 1 and sum(before.values()) > 100 << 20  # a loaded model: its weights and KV cache
    assert httpx.post(f"{router.url}/models/unload", json={"model": "alpha"}).json() == {"success": True}
    assert children_rss(router.proc.pid) == {}  # the memory went with the process
    assert loaded(router.url) == {"alpha": "unloaded", "beta": "unloaded"}
    assert httpx.post(f"{router.url}/models/load", json={"model": "beta"}, timeout=300).json() == {"success": True}
    assert loaded(router.url)["beta"] == "loaded"
    assert httpx.post(f"{router.url}/models/load", json={"model": "nope"}).status_code == 404
