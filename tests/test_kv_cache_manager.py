"""The KV-cache manager: paged blocks per group, prefix caching by chained hashes, counters."""

from __future__ import annotations

import pytest

from weft.contracts.kv_cache import FullAttentionSpec, KVCacheGroupSpec, RecurrentStateSpec, SlidingWindowSpec
from weft.engine.core.kv_cache_manager import KVCacheManager, block_hashes, hash_block


def full_group(name="attn", block_size=4):
    return KVCacheGroupSpec(
        name, ("l0",), FullAttentionSpec(block_size=block_size, dtype="float32", num_kv_heads=1, head_dim=8)
    )


def admit(manager, request_id, tokens, num_tokens=None):
    prefix = manager.find_computed_prefix(tokens)
    assert manager.allocate_slots(request_id, num_tokens or len(tokens), prefix, prompt_length=len(tokens))
    return prefix


def test_chained_hashes_depend_on_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different first block
    assert a[0] == hash_block(None, [1, 2, 3, 4])
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, known=a[:1]) == a  # extending known hashes


def test_prefix_hit_reuses_blocks_and_counts():
    manager = KVCacheManager([full_group()], [16])
    prompt = list(range(10))
    first = admit(manager, "a", prompt)
    assert first.num_tokens == 0
    manager.cache_blocks("a", prompt, len(prompt))
    manager.free("a")
    second = admit(manager, "b", prompt + [99])
    assert second.num_tokens == 8  # two full blocks of 4 reused
    assert manager.block_ids("b")[0][:2] == first_blocks_of(manager, prompt)
    assert manager.stats.queries == 2 and manager.stats.hits == 1
    assert manager.stats.hit_tokens == 8 and manager.stats.query_tokens == 21


def test_blocks_published_for_a_failed_step_are_unpublished():
    """The scheduler publishes a preempted request's blocks that a step in flight fills; if that step fails they
    were never written, and ``uncache`` makes them unfindable (and first in line to be handed out again)."""
    manager = KVCacheManager([full_group()], [4])
    prompt = list(range(10))
    admit(manager, "a", prompt)
    published = manager.cache_blocks("a", prompt, len(prompt))
    assert [block for _, block, _ in published] == list(manager.block_ids("a")[0][:2])
    assert manager.cache_blocks("a", prompt, len(prompt)) == []  # published once
    manager.free("a")
    assert first_blocks_of(manager, prompt) == tuple(block for _, block, _ in published)
    manager.uncache(published)
    assert manager.find_computed_prefix(prompt + [0]).num_tokens == 0
    admit(manager, "b", [50, 51, 52, 53])
    assert manager.block_ids("b")[0][0] in {block for _, block, _ in published}


def first_blocks_of(manager, prompt):
    return manager.find_computed_prefix(prompt + [0]).blocks[0]


def test_never_reuses_the_whole_prompt():
    manager = KVCacheManager([full_group()], [16])
    prompt = list(range(8))
    admit(manager, "a", prompt)
    manager.cache_blocks("a", prompt, 8)
    assert manager.find_computed_prefix(prompt).num_tokens == 4  # the last token must be recomputed


def test_different_prefix_misses():
    manager = KVCacheManager([full_group()], [16])
    admit(manager, "a", [1, 2, 3, 4, 5])
    manager.cache_blocks("a", [1, 2, 3, 4, 5], 5)
    assert manager.find_computed_prefix([0, 2, 3, 4, 5]).num_tokens == 0


def test_allocation_failure_changes_nothing_and_free_restores_the_idle_count():
    manager = KVCacheManager([full_group()], [4])
    assert manager.allocate_slots("a", 12)  # 3 blocks
    assert manager.num_free_blocks() == (1,)
    assert not manager.allocate_slots("b", 8)  # needs 2
    assert manager.num_free_blocks() == (1,) and "b" not in manager._blocks
    assert manager.allocate_slots("a", 16)  # grows into the last block
    assert manager.usage() == 1.0
    manager.free("a")
    manager.free("a")  # idempotent
    assert manager.num_free_blocks() == (4,) and manager.usage() == 0.0


def test_cached_blocks_are_evicted_least_recently_freed_first():
    manager = KVCacheManager([full_group(block_size=2)], [4])
    for request, tokens in (("a", [1, 2, 3]), ("b", [5, 6, 7])):
        admit(manager, request, tokens)
        manager.cache_blocks(request, tokens, 2)
    manager.free("a")
    manager.free("b")
    assert manager.allocate_slots("c", 6)  # three fresh blocks: evicts a's cached block, keeps b's
    assert manager.find_computed_prefix([1, 2, 3]).num_tokens == 0
    assert manager.find_computed_prefix([5, 6, 7]).num_tokens == 2


def test_shared_blocks_are_reference_counted():
    manager = KVCacheManager([full_group()], [8])
    prompt = list(range(9))
    admit(manager, "a", prompt)
    manager.cache_blocks("a", prompt, 9)
    admit(manager, "b", prompt)  # shares a's two full blocks while a still runs
    assert manager.block_ids("a")[0][:2] == manager.block_ids("b")[0][:2]
    manager.free("a")
    assert manager.num_free_blocks() == (8 - 3,)  # b still holds the two shared blocks and its own third
    manager.free("b")
    assert manager.num_free_blocks() == (8,)


def test_several_groups_each_get_their_blocks():
    window = KVCacheGroupSpec(
        "window", ("l1",), SlidingWindowSpec(block_size=4, dtype="float32", num_kv_heads=1, head_dim=8, window=8)
    )
    manager = KVCacheManager([full_group(block_size=8), window], [8, 8])
    assert manager.allocate_slots("a", 17)
    full_blocks, window_blocks = manager.block_ids("a")
    assert (len(full_blocks), len(window_blocks)) == (3, 5)
    assert manager.block_ids("a", group_ids=[1]) == (window_blocks,)
    tokens = list(range(17))
    manager.cache_blocks("a", tokens, 17)
    # Hits are whole multiples of both block sizes (8): 16 tokens of the 17.
    assert manager.find_computed_prefix(tokens + [1]).num_tokens == 16


def test_a_group_that_cannot_be_reproduced_disables_prefix_hits():
    state = KVCacheGroupSpec("state", ("l0",), RecurrentStateSpec(block_size=4, dtype="float32", state_elements=16))
    manager = KVCacheManager([full_group(), state], [8, 4])
    tokens = list(range(9))
    admit(manager, "a", tokens)
    assert manager.block_ids("a")[1] and len(manager.block_ids("a")[1]) == 1
    manager.cache_blocks("a", tokens, 9)
    assert not manager.prefix_caching
    assert manager.find_computed_prefix(tokens).num_tokens == 0


def test_prefix_caching_off():
    manager = KVCacheManager([full_group()], [8], enable_prefix_caching=False)
    tokens = list(range(9))
    admit(manager, "a", tokens)
    manager.cache_blocks("a", tokens, 9)
    assert manager.find_computed_prefix(tokens).num_tokens == 0


def test_rejects_mismatched_sizes():
    with pytest.raises(ValueError, match="2 KV-cache groups but 1 block counts"):
        KVCacheManager([full_group(), full_group("other")], [4])


def test_a_lent_block_is_free_until_reclaimed_and_never_released_twice():
    from weft.contracts.kv_connector import LentBlock

    manager = KVCacheManager([full_group()], [4], enable_prefix_caching=False)
    assert manager.allocate_slots("a", 12)  # blocks 0, 1, 2
    blocks = manager.block_ids("a")[0]
    manager.lend(LentBlock("a", 0, 0))
    manager.lend(LentBlock("a", 0, 0))  # twice: nothing more
    manager.lend(LentBlock("a", 0, 1))
    assert manager.num_free_blocks() == (3,) and manager.block_ids("a")[0] == blocks  # still listed
    assert manager.reclaimed() == ()
    assert manager.allocate_slots("b", 4)  # takes a lent block (freed ones are handed out first)
    assert manager.reclaimed() == (LentBlock("a", 0, manager.block_ids("b")[0][0] == blocks[1] and 1 or 0),)
    assert manager.reclaimed() == ()  # reported once
    manager.free("a")  # releases only what it did not lend
    assert manager.num_free_blocks() == (3,)
    manager.free("b")
    assert manager.num_free_blocks() == (4,)
    assert (
        manager.allocate_slots("c", 16) and manager.reclaimed() == ()
    )  # a lent block of an ended request is plain free


def test_a_group_a_connector_fills_is_left_out_of_the_fillable_hit_and_given_fresh_blocks():
    """Core API 1.11 (``KVConnector.fills_groups``): group 0's cached blocks are gone, group 1's not. The hit of
    every group is empty, but group 1 holds two blocks more: a connector filling group 0 may load those tokens,
    and the request then shares group 1's cached blocks and takes fresh ones of group 0."""
    manager = KVCacheManager([full_group("filled"), full_group("kept")], [8, 16])
    prompt = list(range(10))
    admit(manager, "a", prompt)
    manager.cache_blocks("a", prompt, len(prompt))
    kept = manager.block_ids("a")[1][:2]
    manager.free("a")
    pool = manager.pools[0]
    for block in [pool.take() for _ in range(pool.num_free)]:  # group 0 hands every block out: its cache is gone
        pool.release(block)
    assert manager.find_computed_prefix(prompt + [99]).fillable_tokens == 0  # no connector fills anything
    prefix = manager.find_computed_prefix(prompt + [99], filled_groups=(0,))
    assert (prefix.num_tokens, prefix.fillable_tokens) == (0, 8)
    with pytest.raises(ValueError, match="at most 8 are fillable, in multiples of 4"):
        manager.filled(prefix, 6)
    filled = manager.filled(prefix, 4)  # the connector loads one block
    assert filled.blocks == ((), kept[:1]) and filled.num_tokens == 0
    assert manager.allocate_slots("b", 11, filled, prompt_length=11)
    blocks = manager.block_ids("b")
    assert blocks[1][0] == kept[0] and kept[1] not in blocks[1]  # the second block is computed, so not shared
    assert len(blocks[0]) == 3 and manager.stats.hit_tokens == 0  # fresh blocks; only hits of every group count
