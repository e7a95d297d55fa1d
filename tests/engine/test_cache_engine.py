"""KV tensors: batched swap copies move exactly the named blocks; export/import round trip."""

import numpy as np
import pytest
import torch

from fairbatch.kv.cache_engine import CacheEngine, KVLayout, num_blocks_for_budget


def filled(dtype=torch.float32, gpu=6, cpu=5, device="cpu"):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=3, dtype=dtype)
    ce = CacheEngine(layout, gpu, cpu, device)
    # every element encodes (layer, k/v, block): a wrong copy shows up as a wrong number
    vals = torch.arange(2 * 2 * gpu, dtype=torch.float32).reshape(2, 2, gpu, 1, 1, 1)
    ce.gpu_cache.copy_(vals.expand_as(ce.gpu_cache).to(dtype))
    return ce


def test_layout_sizes():
    layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=32, block_size=16, dtype=torch.float32)
    assert layout.bytes_per_block == 2 * 4 * 16 * 4 * 32 * 4
    assert num_blocks_for_budget(layout, 10 * layout.bytes_per_block + 5) == 10
    ce = CacheEngine(layout, 3, 2)
    assert len(ce.layer_caches()) == 4
    assert ce.layer_caches()[0].shape == (2, 3, 16, 4, 32)


def test_swap_out_then_in_moves_exact_blocks():
    ce = filled()
    before = ce.gpu_cache.clone()
    ce.swap_out([(4, 0), (1, 3)])
    assert torch.equal(ce.cpu_cache[:, :, 0], before[:, :, 4])
    assert torch.equal(ce.cpu_cache[:, :, 3], before[:, :, 1])
    assert ce.cpu_cache[:, :, [1, 2, 4]].abs().sum() == 0  # untouched swap blocks stay zero
    ce.gpu_cache.zero_()
    ce.swap_in([(3, 5), (0, 2)])
    assert torch.equal(ce.gpu_cache[:, :, 5], before[:, :, 1])
    assert torch.equal(ce.gpu_cache[:, :, 2], before[:, :, 4])
    assert ce.gpu_cache[:, :, [0, 1, 3, 4]].abs().sum() == 0
    assert ce.bytes_swapped == {
        "in": 2 * ce.layout.bytes_per_block,
        "out": 2 * ce.layout.bytes_per_block,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_export_import_numpy_round_trip(dtype):
    src = filled(dtype)
    src.swap_out([(2, 1), (5, 4)])
    data = src.export_blocks([1, 4])
    assert isinstance(data, np.ndarray)
    assert data.shape == (2, 2, 2, 3, 2, 4)
    dst = filled(dtype)
    dst.cpu_cache.zero_()
    dst.import_blocks([0, 2], data)
    assert torch.equal(dst.cpu_cache[:, :, 0], src.gpu_cache[:, :, 2])
    assert torch.equal(dst.cpu_cache[:, :, 2], src.gpu_cache[:, :, 5])


def test_import_rejects_wrong_shape():
    ce = filled()
    with pytest.raises(ValueError, match="expected"):
        ce.import_blocks([0], np.zeros((2, 2, 1, 3, 2, 5), dtype=np.float32))
