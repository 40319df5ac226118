"""Token tiles and vocabulary slices sized by bytes: few large products (few kernel launches)
with bounded temporaries. The sizes are pure arithmetic; the launches are counted on the real
functions (aten matrix products, through a dispatch mode) with the byte bounds made small."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loongtrain.model import config
from loongtrain.model.config import TILE_BYTES, TILE_TEMP_BYTES, VOCAB_SLICE_BYTES, token_tile, vocab_slice_rows
from loongtrain.model.lean import lean_normed_projections
from loongtrain.model.loss import lm_loss
from loongtrain.model.norm import RMSNorm, tiles

pytestmark = pytest.mark.unit
PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default}


class _CountProducts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.products += func in PRODUCTS
        return func(*args, **(kwargs or {}))


def test_tiles_and_slices_fill_their_byte_bounds():
    # the GPU check's 1.1B model (dim 2048): 32K tokens in two tiles (4096-token tiles made eight)
    assert token_tile(2048) == 16384 and len(tiles(32768, width=2048)) == 2
    assert token_tile(4096) == 8192  # Llama-3-8B
    for width in (64, 2048, 4096, 5120):
        tile = token_tile(width)
        per_token = TILE_TEMP_BYTES * width
        assert tile % 1024 == 0 and per_token * tile <= TILE_BYTES < per_token * (tile + 1024)
    # the whole 32K vocabulary of the 1.1B model in one product; Llama-3's 128K in slices
    assert vocab_slice_rows(32000, 2048, 2) == 32000
    rows = vocab_slice_rows(128256, 4096, 2)
    assert rows % 1024 == 0 and 6 * 4096 * rows <= VOCAB_SLICE_BYTES < 6 * 4096 * (rows + 1024)
    with pytest.raises(ValueError, match="width=0 must be positive"):
        token_tile(0)


def test_the_projections_run_one_product_per_weight_and_tile(monkeypatch):
    """RMSNorm + q/k/v projections over 2048 tokens of width 64 with tiles of 1024 tokens (the
    byte bound made small): 3 products a tile forward, 6 backward; one tile where it fits."""
    torch.manual_seed(0)
    d = 64
    norm = RMSNorm(d, 1e-5)
    torch.nn.init.ones_(norm.weight)
    wq, wk, wv = (torch.nn.Linear(d, out, bias=False) for out in (64, 32, 32))
    x = torch.randn(1, 2048, d, requires_grad=True)
    for tile_bytes, n_tiles in ((TILE_TEMP_BYTES * d * 1024, 2), (TILE_BYTES, 1)):
        monkeypatch.setattr(config, "TILE_BYTES", tile_bytes)
        with _CountProducts() as count:
            q, k, v = lean_normed_projections(x, norm, wq, wk, wv)
            (q.sum() + k.sum() + v.sum()).backward()
        assert count.products == 9 * n_tiles, (tile_bytes, count.products)


def test_the_chunked_loss_reads_a_float32_master_in_as_few_slices_as_fit(monkeypatch):
    """bf16 hidden states, a float32 [vocab, dim] master: per chunk one logits product, one input
    gradient and one weight gradient product per vocabulary slice (the byte bound set to fit 128
    rows of 256: two slices; by default the whole vocabulary)."""
    torch.manual_seed(0)
    vocab, d, tokens, chunk = 256, 32, 64, 32
    h = torch.randn(tokens, d, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, d, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    for slice_bytes, slices in (((4 + 2) * d * 128, 2), (VOCAB_SLICE_BYTES, 1)):
        monkeypatch.setattr(config, "VOCAB_SLICE_BYTES", slice_bytes)
        monkeypatch.setattr(config, "VOCAB_SLICE_MULTIPLE", 128)
        with _CountProducts() as count:
            loss, _ = lm_loss(h, weight, labels, chunk, None)
            loss.backward()
        assert count.products == (tokens // chunk) * 3 * slices, (slice_bytes, count.products)
