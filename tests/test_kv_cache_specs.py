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
        KVCacheGroupSpec("window", ("l0", "l1"), SlidingWindowSpec(block_size=64, dtype="bfloat16", num_kv_heads=1, head_dim=512, window=128, ring=True)),
        KVCacheGroupSpec("csa", ("l1",), CompressedSpec(block_size=64, dtype="bfloat16", compress_ratio=4, entry_dim=512)),
        KVCacheGroupSpec("hca", ("l0",), CompressedSpec(block_size=128, dtype="bfloat16", compress_ratio=128, entry_dim=512)),
        KVCacheGroupSpec("indexer", ("l1",), CompressedSpec(block_size=64, dtype="bfloat16", compress_ratio=4, entry_dim=128)),
        KVCacheGroupSpec("compressor", ("l0", "l1"), RecurrentStateSpec(block_size=64, dtype="float32", state_elements=8 * 1024)),
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
