"""engine.kv_transfer without a model: `--kv-transfer-config` parsing, and NIXL reads of KV blocks
between two caches (two agents in this process, talking over UCX as two servers would)."""
import time

import numpy as np
import pytest
import torch

from engine.kv_transfer import KVTransferConfig
from engine.kv_transfer.nixl import KVLayout, NixlTransport, block_runs


def test_config_parsing():
    c = KVTransferConfig.from_json('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": 0, '
                                   '"kv_connector_extra_config": {"abort_request_timeout": 3}}')
    assert c.is_producer and c.is_consumer and c.abort_request_timeout == 3 and c.handshake_timeout == 10
    assert len(c.engine_id) == 32 and c.engine_id != KVTransferConfig("NixlConnector", "kv_consumer").engine_id
    for text, message in [('{"kv_role": "kv_producer"}', "needs kv_connector"),
                          ('{"kv_connector": "NixlConnector", "kv_role": "prefill"}', "kv_role must be"),
                          ('{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}', "kv_connector must be"),
                          ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_size": 1}',
                           "unsupported --kv-transfer-config key(s): kv_buffer_size"),
                          ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
                           '"kv_connector_extra_config": {"abort_request_timeout": 0}}', "positive number"),
                          ("[1]", "JSON object"), ("{", "not valid JSON")]:
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


def test_layout_mismatch_is_refused():
    a = KVLayout.of(_cache(4, "NHD"), 16)
    assert a.chunk_bytes == 16 * 2 * 8 * 4 and a.block_stride == a.chunk_bytes
    assert a.mismatch(KVLayout.of(_cache(4, "NHD"), 32)) == "block_size differs: 32 there, 16 here"
    assert "dtype differs" in a.mismatch(KVLayout.of(_cache(4, "NHD").half(), 16))
    descs = a.descs(np.array([1]), np.array([2]))
    assert descs.shape == (6, 3) and (descs[:, 1] == 2 * a.chunk_bytes).all()
