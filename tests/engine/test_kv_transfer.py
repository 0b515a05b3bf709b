"""engine.kv_transfer: `--kv-transfer-config` parsing, NIXL reads of KV blocks between two caches, and
a prefill engine and a decode engine in this process (their agents talk over UCX as two servers' would),
with the leak check of conftest after each test."""

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.config import KVTransferConfig
from engine.kv_transfer.nixl import KVLayout, NixlTransport, block_runs

pytestmark = pytest.mark.slow  # two engines and their NIXL agents per test


def test_config_parsing():
    c = KVTransferConfig.from_json(
        '{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": 0, '
        '"kv_connector_extra_config": {"abort_request_timeout": 3}}'
    )
    assert c.is_producer and c.is_consumer and c.abort_request_timeout == 3 and c.handshake_timeout == 10
    assert len(c.engine_id) == 32 and c.engine_id != KVTransferConfig("NixlConnector", "kv_consumer").engine_id
    for text, message in [
        ('{"kv_role": "kv_producer"}', "needs kv_connector"),
        ('{"kv_connector": "NixlConnector", "kv_role": "prefill"}', "kv_role must be"),
        ('{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}', "kv_connector must be"),
        (
            '{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_size": 1}',
            "unknown --kv-transfer-config key(s): kv_buffer_size",
        ),
        (
            '{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
            '"kv_connector_extra_config": {"abort_request_timeout": 0}}',
            "positive number",
        ),
        ("[1]", "JSON object"),
        ("{", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            KVTransferConfig.from_json(text)


def test_block_runs_merge_only_blocks_consecutive_on_both_sides():
    local, remote, counts = block_runs([4, 5, 6, 9, 10, 2], [7, 8, 9, 10, 12, 13], contiguous=True)
    assert local.tolist() == [4, 9, 10, 2] and remote.tolist() == [7, 10, 12, 13] and counts.tolist() == [3, 1, 1, 1]
    local, remote, counts = block_runs([4, 5], [7, 8], contiguous=False)
    assert local.tolist() == [4, 5] and counts.tolist() == [1, 1]


def _cache(num_blocks: int, layout: str) -> torch.Tensor:
    """[layers 3, K/V, blocks, block 16 tokens x 2 heads x 8 dims] in two inner layouts (NHD, HND)."""
    shape = (3, 2, num_blocks, 16, 2, 8) if layout == "NHD" else (3, 2, num_blocks, 2, 16, 8)
    return torch.zeros(shape, dtype=torch.float32)


@pytest.mark.parametrize("inner", ["NHD", "HND"])
def test_nixl_reads_whole_blocks_of_every_layer(inner):
    pytest.importorskip("nixl", reason="needs the [kv] extra")
    producer_cache, consumer_cache = _cache(12, inner), _cache(9, inner)
    producer_cache.copy_(torch.randn_like(producer_cache))
    consumer_cache.fill_(-1.0)
    producer = NixlTransport("test-producer", producer_cache, 16, "127.0.0.1")
    consumer = NixlTransport("test-consumer", consumer_cache, 16, "127.0.0.1")
    consumer.add_remote(producer.metadata())
    remote_ids, local_ids = [3, 4, 5, 11, 0], [6, 7, 8, 1, 2]  # runs of 3 and two single blocks
    handle = consumer.read("test-producer", local_ids, remote_ids, b"req-1")
    while (state := consumer.state(handle)) == "PROC":
        pass
    consumer.release(handle)
    assert state == "DONE"
    assert torch.equal(consumer_cache[:, :, local_ids], producer_cache[:, :, remote_ids])
    untouched = [b for b in range(9) if b not in local_ids]
    assert (consumer_cache[:, :, untouched] == -1).all()
    deadline = time.monotonic() + 10
    while not (notifs := producer.notifications()) and time.monotonic() < deadline:
        time.sleep(0.01)  # the producer learns the read is done (to free the blocks)
    assert notifs == [b"req-1"]
    with pytest.raises(ValueError, match="remote block ids outside"):
        consumer.read("test-producer", [0], [12], b"req-2")
    producer.close()
    consumer.close()


def test_process_with_an_open_transport_exits_cleanly():
    """A transport nobody closed must not abort the interpreter's exit: its progress thread, busy in
    NIXL's C++ at finalization, used to end in std::terminate ("terminate called without an active
    exception", exit -6), which failed a CI run after every test had passed."""
    pytest.importorskip("nixl", reason="needs the [kv] extra")
    script = textwrap.dedent("""
        import time, torch
        import engine.kv_transfer.nixl as nixl
        nixl.IDLE_PROGRESS_INTERVAL = 0.0  # the thread is always in NIXL: the race is certain
        transports = [nixl.NixlTransport(f"exit-{i}", torch.zeros(3, 2, 4, 16, 2, 8), 16, "127.0.0.1")
                      for i in range(2)]
        time.sleep(0.2)
    """)
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr[-2000:]


def test_layout_mismatch_is_refused():
    a = KVLayout.of(_cache(4, "NHD"), 16)
    assert a.chunk_bytes == 16 * 2 * 8 * 4 and a.block_stride == a.chunk_bytes
    assert a.mismatch(KVLayout.of(_cache(4, "NHD"), 32)) == "block_size differs: 32 there, 16 here"
    assert "dtype differs" in a.mismatch(KVLayout.of(_cache(4, "NHD").half(), 16))
    descs = a.descs(np.array([1]), np.array([2]))
    assert descs.shape == (6, 3) and (descs[:, 1] == 2 * a.chunk_bytes).all()


# ---------------------------------------------------------------------------------------------
# Two engines in this process: a producer (prefill) and a consumer (decode)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    pytest.importorskip("nixl", reason="needs the [kv] extra")
    from conftest import make_llm

    producer = make_llm(
        kv_transfer_config=KVTransferConfig(
            "NixlConnector", "kv_producer", kv_connector_extra_config={"abort_request_timeout": 2}
        )
    )
    consumer = make_llm(kv_transfer_config=KVTransferConfig("NixlConnector", "kv_consumer"))
    yield producer, consumer
    for llm in (producer, consumer):
        llm.engine.engine_core.kv_connector.close()


def _prefill(producer, prompts: list[list[int]]) -> list[dict]:
    """Runs the prompts to one token with do_remote_decode; returns their kv_transfer_params."""
    params = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    return [out.kv_transfer_params for out in producer.generate(prompts, params, use_tqdm=False)]


def _step_until(engine, done, timeout: float = 10) -> None:
    """Steps an engine (which polls its KV connector) until `done()`."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline
        engine.step()
        time.sleep(0.005)


def test_decode_engine_pulls_the_prompt_instead_of_computing_it(pair):
    producer, consumer = pair
    tok = consumer.tokenizer
    prompts = [
        tok.encode("The capital of France is"),
        tok.encode("Hi"),
        tok.encode("1, 2, 3, 4, 5, 6, 7, 8,"),
        tok.encode("Once upon a time, " * 12),
    ]  # 1 token, part of a block, two blocks, many blocks
    greedy = SamplingParams(temperature=0, max_tokens=12)
    reference = consumer.generate(prompts, greedy, use_tqdm=False)
    consumer.reset_prefix_cache()
    before = consumer.engine.stats()
    params = _prefill(producer, prompts)
    pool = producer.engine.engine_core.kv.pool
    assert [len(p["remote_block_ids"]) for p in params] == [-(-len(p) // 16) for p in prompts]
    assert pool.num_free_blocks < len(pool.blocks)  # pinned until pulled
    outs = consumer.generate(
        prompts,
        [SamplingParams(temperature=0, max_tokens=12, extra_args={"kv_transfer_params": p}) for p in params],
        use_tqdm=False,
    )
    for out, ref, prompt in zip(outs, reference, prompts):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.num_cached_tokens == len(prompt) - 1
    after = consumer.engine.stats()
    computed = after.prompt_tokens_by_source["local_compute"] - before.prompt_tokens_by_source["local_compute"]
    assert computed == after.prompt_tokens_recomputed - before.prompt_tokens_recomputed == len(prompts)
    assert after.prompt_tokens_by_source["external_kv_transfer"] - before.prompt_tokens_by_source[
        "external_kv_transfer"
    ] == sum(map(len, prompts))
    _step_until(producer.engine, lambda: pool.num_free_blocks == len(pool.blocks))  # freed once pulled


def test_aborted_pull_and_unpulled_blocks_free_everything(pair):
    producer, consumer = pair
    prompt = consumer.tokenizer.encode("A long time ago in a galaxy far, far away " * 5)
    params = _prefill(producer, [prompt, prompt])
    # the decode request is aborted while its pull may be in flight: its blocks wait for the read
    rid = consumer.engine.add_request(None, prompt, SamplingParams(extra_args={"kv_transfer_params": params[0]}))
    consumer.engine.step()
    consumer.engine.abort_request(rid)
    _step_until(consumer.engine, lambda: not consumer.engine.engine_core.kv_connector._loads)
    # nobody pulls the second one: the producer frees it after abort_request_timeout (2 s)
    expired = producer.engine.stats().kv_expired_requests
    pool = producer.engine.engine_core.kv.pool
    _step_until(producer.engine, lambda: pool.num_free_blocks == len(pool.blocks), timeout=30)
    # the unpulled one expired; so did the aborted one if its pull had not started yet
    assert expired + 1 <= producer.engine.stats().kv_expired_requests <= expired + 2
    with pytest.raises(ValueError, match="needs n = 1"):
        consumer.engine.add_request(None, prompt, SamplingParams(n=2, extra_args={"kv_transfer_params": params[1]}))
