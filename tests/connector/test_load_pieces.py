"""Loads queued by pieces of layers (connector.worker_side without ``layerwise``): the
mover writes exactly the layers of each piece, and the pieces together write what the
whole move writes (CPU; the GPU engine tests run the same moves on CUDA)."""

from __future__ import annotations

import pytest
import torch

from connector.transfer import KVMover
from connector.worker_side import load_layer_pieces

NUM_LAYERS = 5
CHUNK_SHAPE = (NUM_LAYERS, 2, 8, 2, 4)  # [layers, 2, tokens, kv heads, head_dim]


def _kv_cache() -> torch.Tensor:
    return torch.zeros(NUM_LAYERS, 2, 3, 4, 2, 4)  # [layers, 2, blocks, block_size, heads, dim]


def test_layer_pieces_cover_every_layer_in_order_and_shrink_towards_the_end():
    assert load_layer_pieces(32) == [(0, 11), (11, 19), (19, 26), (26, 30), (30, 32)]  # the default: 5
    assert load_layer_pieces(32, 2) == [(0, 21), (21, 32)]
    assert load_layer_pieces(32, 4) == [(0, 13), (13, 22), (22, 29), (29, 32)]
    assert load_layer_pieces(5, 4) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert load_layer_pieces(2, 4) == [(0, 1), (1, 2)]
    assert load_layer_pieces(3, 1) == [(0, 3)]
    assert load_layer_pieces(1, 5) == [(0, 1)]


@pytest.mark.parametrize("num_layers", [1, 2, 3, 5, 8, 16, 28, 32, 36, 40, 64, 80, 126])
@pytest.mark.parametrize("num_pieces", [1, 2, 3, 4, 5, 8])
def test_layer_pieces_are_contiguous_nonempty_and_never_grow(num_layers, num_pieces):
    pieces = load_layer_pieces(num_layers, num_pieces)
    assert pieces[0][0] == 0 and pieces[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
    assert len(pieces) == min(num_pieces, num_layers)
    sizes = [last - first for first, last in pieces]
    assert min(sizes) >= 1
    # sizes never grow by more than the one layer that rounding may move
    assert all(b <= a + 1 for a, b in zip(sizes, sizes[1:], strict=False))
    assert sizes[-1] <= sizes[0]


def test_a_piece_writes_its_layers_only_and_the_pieces_make_the_whole_move():
    mover = KVMover(torch.device("cpu"), torch.float32, CHUNK_SHAPE)
    chunk = torch.randn(CHUNK_SHAPE, generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([5, 6, 7, -1, 0, 1, 2, 9])
    whole = _kv_cache()
    mover.load(chunk, whole, slots)

    piece = _kv_cache()
    mover.load(chunk, piece, slots, layers=(1, 3))
    assert torch.equal(piece[1:3], whole[1:3])
    assert not piece[:1].any() and not piece[3:].any()

    by_pieces = _kv_cache()
    for first, last in load_layer_pieces(NUM_LAYERS, 3):
        mover.load(chunk, by_pieces, slots, layers=(first, last))
    assert torch.equal(by_pieces, whole)


def test_layer_and_layers_are_exclusive():
    mover = KVMover(torch.device("cpu"), torch.float32, CHUNK_SHAPE)
    with pytest.raises(ValueError, match="layer or layers"):
        mover.load(torch.zeros(CHUNK_SHAPE), _kv_cache(), torch.arange(8), 0, layers=(0, 1))
