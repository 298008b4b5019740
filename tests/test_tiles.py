"""Exact attention at any zoom: every pooled level equals a plain pooling of the exact map, every exact view
equals trace.attention on the same block, in full, sliding-window and soft-capped layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from snapkv_lab.core.attention import AttentionSettings
from snapkv_lab.core.trace import AttentionTrace
from snapkv_lab.views.tiles import HEAD_MEAN, AttentionTiles

N, HEADS, KV_HEADS, DIM = 203, 4, 2, 8  # 203: no block size divides it, so the last cells are cut short


@pytest.fixture(scope="module")
def trace():
    torch.manual_seed(0)
    return AttentionTrace(
        token_ids=torch.arange(N), tokens=[f"t{i}" for i in range(N)], prompt_len=150,
        queries=[torch.randn(HEADS, N, DIM) * 2, torch.randn(HEADS, N, DIM) * 2],
        keys=[torch.randn(KV_HEADS, N, DIM), torch.randn(KV_HEADS, N, DIM)],
        attention_settings=[AttentionSettings(0.35), AttentionSettings(0.35, sliding_window=17, softcap=5.0)],
        layers=[0, 3])


def plain_map(trace, layer, head) -> torch.Tensor:
    """The whole (N, N) map, one head or the mean of all: small enough here to hold."""
    full = trace.attention(layer)
    return full.mean(0) if head == HEAD_MEAN else full[head]


def plain_pool(matrix: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block max and block mean over the cells each block has (the last ones are cut by the map's end)."""
    block_max = F.max_pool2d(matrix[None, None], block, ceil_mode=True)[0, 0]
    sums = F.avg_pool2d(matrix[None, None], block, ceil_mode=True, divisor_override=1)[0, 0]
    counts = F.avg_pool2d(torch.ones_like(matrix)[None, None], block, ceil_mode=True, divisor_override=1)[0, 0]
    return block_max, sums / counts


@pytest.mark.parametrize("base_cells", [8, 64, 512])  # base blocks of 32, 4 and 1 tokens
@pytest.mark.parametrize("layer", [0, 3])
@pytest.mark.parametrize("head", [0, 3, HEAD_MEAN])
def test_every_level_is_a_plain_pooling_of_the_exact_map(trace, base_cells, layer, head):
    tiles = AttentionTiles(trace, base_cells=base_cells, progress=False)
    exact = plain_map(trace, layer, head)
    for block in (1, 2, 4, 8, 32, 64, 256):
        for rows, cols in ((None, None), (slice(37, 150), slice(5, 99)), (slice(190, 203), slice(0, 203))):
            tile = tiles.view(layer, head, rows, cols, block=block)
            assert tile.block == block
            assert tile.rows.start % block == 0 and tile.cols.start % block == 0  # snapped outwards to the grid
            if rows is not None:
                assert tile.rows.start <= rows.start and tile.rows.stop >= rows.stop
            expected_max, expected_mean = plain_pool(exact[tile.rows.start:tile.rows.stop,
                                                           tile.cols.start:tile.cols.stop], block)
            torch.testing.assert_close(tile.max, expected_max, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(tile.mean, expected_mean, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("layer", [0, 3])
def test_exact_views_are_the_trace_attention(trace, layer):
    tiles = AttentionTiles(trace, base_cells=16, progress=False)
    for head in range(HEADS):
        block = tiles.exact(layer, head, slice(120, 203), slice(90, 170))
        torch.testing.assert_close(block, trace.attention(layer, heads=head, queries=slice(120, 203),
                                                          keys=slice(90, 170))[0], atol=1e-6, rtol=1e-5)
    view = tiles.view(layer, 2, slice(10, 40), slice(0, 40), max_cells=64)
    assert view.block == 1
    torch.testing.assert_close(view.max, trace.attention(layer, heads=2, queries=slice(10, 40), keys=slice(0, 40))[0])


def test_the_block_fits_the_screen(trace):
    tiles = AttentionTiles(trace, base_cells=16, progress=False)
    assert tiles.base_block == 16
    overview = tiles.view(0, 1, max_cells=32)
    assert overview.block == 8 and overview.max.shape == (26, 26)  # ceil(203 / 8)
    assert tiles.view(0, 1, slice(0, 60), slice(0, 20), max_cells=32).block == 2
    assert tiles.view(0, 1, slice(0, 30), slice(0, 20), max_cells=32).block == 1
    # 64 tokens from position 1 fit 32 cells of 2 only unsnapped: snapped outwards they need 33, so blocks of 4
    assert tiles.view(0, 1, slice(1, 65), slice(1, 65), max_cells=32).max.shape == (17, 17)


def test_the_base_pass_runs_once_per_head_and_is_bounded(trace):
    tiles = AttentionTiles(trace, base_cells=16, keep=2, progress=False)
    tiles.view(0, 0)
    base = tiles._bases[(0, 0)]
    assert base.max.shape == (13, 13) and base.lse.shape == (1, N)  # cells of 16 tokens, not N x N
    tiles.view(0, 0, slice(0, 64), slice(0, 64))
    assert tiles._bases[(0, 0)] is base
    tiles.view(0, 1), tiles.view(3, 1)
    assert list(tiles._bases) == [(0, 1), (3, 1)]  # least recently used dropped


def test_bad_views_are_refused(trace):
    tiles = AttentionTiles(trace, progress=False)
    with pytest.raises(ValueError, match="head must be"):
        tiles.view(0, HEADS)
    with pytest.raises(KeyError, match="was not recorded"):
        tiles.view(1, 0)
    with pytest.raises(ValueError, match="power of two"):
        tiles.view(0, 0, block=3)
    with pytest.raises(ValueError, match="holds no position"):
        tiles.view(0, 0, slice(300, 400))
    with pytest.raises(TypeError, match="consecutive"):
        tiles.view(0, 0, [1, 2, 3])


def test_precomputed_tiles_travel_with_the_trace(trace, tmp_path):
    tiles = AttentionTiles(trace, base_cells=16, progress=False).precompute(layers=[3])
    assert set(tiles._bases) == {(3, h) for h in [*range(HEADS), HEAD_MEAN]}
    path = tiles.save(tmp_path / "tiles.safetensors")
    loaded = AttentionTiles.load(trace, path, progress=False)
    assert loaded.base_block == 16 and loaded._bases == {}  # nothing read until viewed
    for head in (1, HEAD_MEAN):
        expected = tiles.view(3, head, slice(20, 203), slice(0, 150), block=32)
        got = loaded.view(3, head, slice(20, 203), slice(0, 150), block=32)
        assert torch.equal(got.max, expected.max) and torch.equal(got.mean, expected.mean)
    assert (3, 1) in loaded._bases and (3, 2) not in loaded._bases  # read lazily, head by head
    exact = loaded.exact(3, 2, slice(100, 140), slice(90, 140))  # the stored log-sum-exp serves exact views
    torch.testing.assert_close(exact, trace.attention(3, heads=2, queries=slice(100, 140), keys=slice(90, 140))[0])
    loaded.view(0, 0)  # a head the file lacks is computed as usual
    other = AttentionTrace(token_ids=trace.token_ids.flip(0), tokens=trace.tokens, prompt_len=trace.prompt_len,
                           queries=trace.queries, keys=trace.keys, attention_settings=trace.attention_settings,
                           layers=trace.layers)
    with pytest.raises(ValueError, match="another trace"):
        AttentionTiles.load(other, path)
