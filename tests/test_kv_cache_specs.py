"""KV-cache specs in the contracts: sizes and the prefix-cacheable / transferable projections."""

import msgspec
import pytest

from weft.contracts.kv_cache import (
    CompressedSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    prefix_cacheable_groups,
    transferable_groups,
)


def deepseek_like_groups():
    return (
        KVCacheGroupSpec(
            "window",
            ("l0", "l1"),
            SlidingWindowSpec(block_size=64, dtype="bfloat16", num_kv_heads=1, head_dim=512, window=128, ring=True),
        ),
        KVCacheGroupSpec(
            "csa", ("l1",), CompressedSpec(block_size=64, dtype="bfloat16", compress_ratio=4, entry_dim=512)
        ),
        KVCacheGroupSpec(
            "hca", ("l0",), CompressedSpec(block_size=128, dtype="bfloat16", compress_ratio=128, entry_dim=512)
        ),
        KVCacheGroupSpec(
            "indexer", ("l1",), CompressedSpec(block_size=64, dtype="bfloat16", compress_ratio=4, entry_dim=128)
        ),
        KVCacheGroupSpec(
            "compressor", ("l0", "l1"), RecurrentStateSpec(block_size=64, dtype="float32", state_elements=8 * 1024)
        ),
    )


def test_projections_separate_storable_from_transferable():
    groups = deepseek_like_groups()
    assert prefix_cacheable_groups(groups) == (1, 2, 3)
    assert transferable_groups(groups) == (0, 1, 2, 3, 4)


def test_sizes():
    full = FullAttentionSpec(block_size=16, dtype="float16", num_kv_heads=8, head_dim=128)
    assert full.page_size_bytes() == 2 * 16 * 8 * 128 * 2
    assert full.blocks_for_tokens(0) == 0 and full.blocks_for_tokens(16) == 1 and full.blocks_for_tokens(17) == 2
    ring = SlidingWindowSpec(block_size=16, dtype="float16", num_kv_heads=1, head_dim=64, window=32, ring=True)
    assert ring.blocks_for_tokens(10_000) == 3 and not ring.prefix_cacheable
    assert SlidingWindowSpec(block_size=16, dtype="float16", num_kv_heads=1, head_dim=64, window=32).prefix_cacheable
    compressed = CompressedSpec(block_size=64, dtype="bfloat16", compress_ratio=4, entry_dim=512)
    assert compressed.page_size_bytes() == 16 * 512 * 2
    state = RecurrentStateSpec(block_size=64, dtype="float32", state_elements=100)
    assert state.blocks_for_tokens(10_000) == 1 and state.page_size_bytes() == 400


def test_compressed_block_must_hold_whole_entries():
    with pytest.raises(ValueError, match="block_size 10 must be a multiple of compress_ratio 4"):
        CompressedSpec(block_size=10, dtype="bfloat16", compress_ratio=4, entry_dim=8)


def test_group_specs_round_trip_through_msgspec():
    groups = deepseek_like_groups()
    decoded = msgspec.json.decode(msgspec.json.encode(groups), type=tuple[KVCacheGroupSpec, ...])
    assert decoded == groups


def test_slot_mappings_follow_each_layout():
    import torch

    table = torch.tensor([[7, 3, 5, 9, 2]], dtype=torch.int32)
    rows = torch.zeros(6, dtype=torch.long)
    positions = torch.tensor([0, 15, 16, 47, 48, 70])
    full = FullAttentionSpec(block_size=16, dtype="float16", num_kv_heads=1, head_dim=8)
    assert full.slot_mapping(table, rows, positions).tolist() == [112, 127, 48, 95, 144, 38]
    assert full.paged_attention
    # A ring of ceil(32 / 16) + 1 = 3 blocks: position p sits in block (p // 16) % 3.
    ring = SlidingWindowSpec(block_size=16, dtype="float16", num_kv_heads=1, head_dim=8, window=32, ring=True)
    assert ring.ring_blocks == 3 and not ring.paged_attention
    assert ring.slot_mapping(table, rows, positions).tolist() == [112, 127, 48, 95, 112, 54]
    # Compressed, 16 source tokens (4 entries) per block: the entry each token pools into.
    compressed = CompressedSpec(block_size=16, dtype="float16", compress_ratio=4, entry_dim=8)
    assert compressed.slot_mapping(table, rows, positions).tolist() == [28, 31, 12, 23, 36, 9]
    assert not compressed.paged_attention
    state = RecurrentStateSpec(block_size=16, dtype="float32", state_elements=4)
    assert state.slot_mapping(table, rows, positions).tolist() == [7] * 6 and not state.paged_attention
