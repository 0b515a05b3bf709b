"""The attention-backend choice, FlashInfer's graph-mode workspace sizing and index dtype, and the
CUDA-graph hooks' defaults: all without a GPU (CUDA devices are only named, never touched)."""

import logging
import sys
import types

import pytest
import torch

from engine.worker.cuda_graph import capture_sizes
from models.attention import choose_backend, make_backend
from models.attention.cpu import CPUBackend
from models.attention.flashinfer import WORKSPACE_BYTES, FlashInferBackend, graph_workspace_bytes, paged_kv_indices
from models.attention.torch_native import TorchNativeBackend
from models.config import ModelShape

LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)


# ---- choose_backend / make_backend ----------------------------------------------------------------


def test_float32_on_cuda_falls_back_to_torch_native(caplog):
    with caplog.at_level(logging.INFO, logger="models.attention"):
        assert choose_backend(None, "cuda", torch.float32, flashinfer_ok=True, cpu_kernels_ok=False) == "torch_native"
    assert "float32" in caplog.text and "torch_native" in caplog.text


def test_explicit_flashinfer_in_float32_names_the_dtypes():
    with pytest.raises(ValueError, match="float16 and bfloat16") as e:
        choose_backend("flashinfer", "cuda", torch.float32, flashinfer_ok=True, cpu_kernels_ok=False)
    assert "float32" in str(e.value) and "torch_native" in str(e.value)


def test_make_backend_float32_on_cuda_without_a_gpu():
    """Nothing touches the device: torch_native allocates nothing when built."""
    shape = ModelShape(
        num_layers=2,
        hidden_size=64,
        vocab_size=100,
        total_num_heads=4,
        total_num_kv_heads=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tp_size=1,
        max_position_embeddings=128,
    )
    cuda = torch.device("cuda")
    backend = make_backend(None, cuda, torch.float32, shape, 16)
    assert type(backend) is TorchNativeBackend and (backend.num_heads, backend.head_dim) == (4, 16)
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        make_backend("flashinfer", cuda, torch.float32, shape, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_default_is_flashinfer_when_installed(dtype, caplog):
    assert choose_backend(None, "cuda", dtype, flashinfer_ok=True, cpu_kernels_ok=False) == "flashinfer"
    with caplog.at_level(logging.WARNING, logger="models.attention"):
        assert choose_backend(None, "cuda", dtype, flashinfer_ok=False, cpu_kernels_ok=False) == "torch_native"
    assert "not installed" in caplog.text
    with pytest.raises(ValueError, match="flashinfer-python"):
        choose_backend("flashinfer", "cuda", dtype, flashinfer_ok=False, cpu_kernels_ok=False)


@pytest.mark.parametrize("name", [None, "cpu"])
def test_cpu_uses_its_kernel_when_it_builds(name):
    for dtype in (torch.float32, torch.bfloat16):
        assert choose_backend(name, "cpu", dtype, flashinfer_ok=False, cpu_kernels_ok=True) == "cpu"
        assert choose_backend(name, "cpu", dtype, flashinfer_ok=False, cpu_kernels_ok=False) == "torch_native"
    # the kernel has no float16 path
    assert choose_backend(name, "cpu", torch.float16, flashinfer_ok=False, cpu_kernels_ok=True) == "torch_native"


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_torch_native_when_asked(device_type):
    assert choose_backend("torch_native", device_type, torch.bfloat16, True, True) == "torch_native"


@pytest.mark.parametrize(
    "name, device_type, message",
    [
        ("xformers", "cuda", "unknown attention_backend 'xformers'"),
        ("xformers", "cpu", "unknown attention_backend 'xformers'"),
        ("flashinfer", "cpu", "needs a CUDA device"),
        ("cpu", "cuda", "needs the CPU device"),
    ],
)
def test_impossible_choices_raise(name, device_type, message):
    with pytest.raises(ValueError, match=message):
        choose_backend(name, device_type, torch.bfloat16, flashinfer_ok=True, cpu_kernels_ok=True)


# ---- FlashInfer's graph-mode workspace ------------------------------------------------------------


def test_graph_workspace_arithmetic():
    # batch 1 of Llama-3-8B: one tile of 16 packed rows (4 used) per row: 32 * 1 * 16 * 129 * 4
    assert graph_workspace_bytes(**LLAMA3_8B, batch_size=1) == 32 * 16 * 129 * 4
    # a group of 32 query heads per KV head fills 64-row tiles
    assert graph_workspace_bytes(32, 1, 128, 1) == 32 * 64 * 129 * 4
    assert graph_workspace_bytes(**LLAMA3_8B, batch_size=256) <= WORKSPACE_BYTES
    assert graph_workspace_bytes(**LLAMA3_8B, batch_size=512) > WORKSPACE_BYTES
    first_over = next(
        bs for bs in range(1, 1024) if graph_workspace_bytes(**LLAMA3_8B, batch_size=bs) > WORKSPACE_BYTES
    )
    assert 400 <= first_over <= 416  # the reported overflow began near batch 408


class RecordingWrapper:
    """Stands in for FlashInfer's wrapper classes: keeps the workspace each one was built on."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", **kwargs):
        self.workspace = float_workspace_buffer


@pytest.fixture
def recording_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = module.BatchPrefillWithPagedKVCacheWrapper = RecordingWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)


def llama3_8b_flashinfer() -> FlashInferBackend:
    return FlashInferBackend(**LLAMA3_8B, block_size=16, scale=128**-0.5, dtype=torch.bfloat16, device="cpu")


def test_graph_wrappers_get_a_workspace_that_fits_every_size(recording_flashinfer):
    fi = llama3_8b_flashinfer()
    sizes = capture_sizes(512)
    fi.init_cuda_graph_decode(sizes, max_blocks_per_seq=4)
    for bs in sizes:
        assert fi._graph_decode[bs].workspace.numel() >= graph_workspace_bytes(**LLAMA3_8B, batch_size=bs)
    # the eager wrappers keep FlashInfer's recommended size
    assert fi._eager_decode.workspace.numel() == fi._prefill.workspace.numel() == WORKSPACE_BYTES


def test_graph_wrappers_share_the_eager_workspace_when_it_fits(recording_flashinfer):
    fi = llama3_8b_flashinfer()
    fi.init_cuda_graph_decode(capture_sizes(256), max_blocks_per_seq=4)
    assert all(w.workspace is fi._workspace for w in fi._graph_decode.values())


def test_paged_kv_indices_are_int32_for_an_int64_block_table():
    tables = torch.tensor([[5, 2, 7, 0], [3, 9, 0, 0]], dtype=torch.int64)
    _, _, indices, _ = paged_kv_indices(tables, [9, 4], [0, 1, 2], 4, 0, 2)
    assert indices.dtype == torch.int32 and indices.tolist() == [5, 2, 7, 3]


# ---- CUDA-graph hooks ------------------------------------------------------------------------------


def test_cuda_graph_hooks_do_nothing_by_default():
    backend = TorchNativeBackend(4, 2, 8, 4, 8**-0.5)
    assert backend.supports_cuda_graphs is False and CPUBackend.supports_cuda_graphs is False
    assert backend.init_cuda_graph_decode([1, 2, 4], max_blocks_per_seq=8) is None
    with backend.cuda_graph_decode(4) as entered:
        assert entered is None
    assert FlashInferBackend.supports_cuda_graphs is True
