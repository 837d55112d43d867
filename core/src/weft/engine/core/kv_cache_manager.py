"""Paged KV-cache blocks for every KV-cache group of a model, with prefix caching.

Each group (:class:`weft.contracts.kv_cache.KVCacheGroupSpec`) has its own
:class:`BlockPool`, because groups differ in page size and block count. A
request holds a block list per group. Prefix caching identifies a full block by
the chained hash of its tokens and of every token before it, so two requests
share a block only when their whole prefix up to that block is identical.

Prefix hits are used only when every group is prefix-cacheable or checkpointed: a
group that holds a ring buffer or recurrent state cannot reproduce the state after
an arbitrary prefix, so reusing the other groups' blocks alone would be wrong,
unless its model restores it from a checkpoint group (``KVCacheGroupSpec.checkpointed``).
A checkpointed group takes fresh blocks on a hit; only prefix-cacheable groups are looked up.

A KV connector may fill some groups of a hit from its own copy (``KVConnector.fills_groups``,
weft-hisparse's host pool of the compressed entries): the prefix then found also reports the tokens
after it that every other prefix-cacheable group holds (:attr:`ComputedPrefix.fillable_tokens`), and
:meth:`KVCacheManager.filled` shares those groups' blocks for the tokens the connector loads.

A KV connector may lend a running request's block back to its pool (:meth:`KVCacheManager.lend`,
the contract's "Lent blocks"): the pool counts it free, the request keeps it in its block list
until the pool hands it out again, and :meth:`KVCacheManager.reclaimed` reports that hand-out.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from math import lcm

import msgspec

from weft.contracts.kv_cache import CheckpointSpec, KVCacheGroupSpec
from weft.contracts.kv_connector import LentBlock

BlockItem = tuple[int, int, bytes]
"""A run of prompt positions whose KV depends on more than their token ids: ``(start, end, key)``, the key naming
the content (an image's item hash and which of its rows the run holds: :attr:`Request.block_items
<weft.engine.core.request.Request.block_items>`)."""


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """The chained hash of one full block: its tokens, the hash of the block before it, and ``extra`` (the keys
    of the items overlapping it)."""
    digest = hashlib.sha256(parent or b"\0")
    digest.update(array("q", token_ids).tobytes())
    if extra:
        digest.update(extra)
    return digest.digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, known: list[bytes] | None = None, items: Sequence[BlockItem] = ()
) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``, extending the ``known`` leading ones.

    ``items``: runs of positions whose contents are not their ids alone (images behind placeholder ids); a block
    overlapping one hashes its key and where it starts in the block too, so two different images behind the same
    ids never share a block."""
    hashes: list[bytes] = list(known or ())
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra = b"".join(
            key + (item_start - start).to_bytes(8, "little", signed=True)
            for item_start, item_end, key in items
            if item_start < end and item_end > start
        )
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start:end], extra))
    return hashes


class BlockPool:
    """Blocks of one group: reference counts, a free list in eviction order, and the hash index.

    A free block that holds a cached prefix stays findable by its hash until the
    pool hands it out again; free blocks are reused least recently freed first,
    blocks without cached contents before any cached one.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV-cache group needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free block for new contents (evicting what it cached); its reference count becomes 1."""
        block, _ = self._free.popitem(last=False)
        cached = self._hash_of[block]
        if cached is not None:
            del self._by_hash[cached]
            self._hash_of[block] = None
        self._ref_counts[block] = 1
        return block

    def touch(self, block: int) -> None:
        """Add a reference to a block found by hash (taking it off the free list if idle)."""
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free[block] = None
            if self._hash_of[block] is None:
                self._free.move_to_end(block, last=False)

    def is_idle(self, block: int) -> bool:
        return self._ref_counts[block] == 0

    def lookup(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def cache(self, block: int, block_hash: bytes) -> bool:
        """Record that ``block`` holds the prefix ending in ``block_hash`` (first holder wins); whether it did."""
        if self._hash_of[block] is None and block_hash not in self._by_hash:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash
            return True
        return False

    def uncache(self, block: int, block_hash: bytes) -> None:
        """Forget that ``block`` holds ``block_hash`` (if it still does): its contents are not what was recorded."""
        if self._hash_of[block] != block_hash:
            return
        del self._by_hash[block_hash]
        self._hash_of[block] = None
        if self._ref_counts[block] == 0:
            self._free.move_to_end(block, last=False)


class PrefixCacheStats(msgspec.Struct):
    """Counters of prefix-cache lookups, in requests and tokens."""

    queries: int = 0
    hits: int = 0
    """Requests that reused at least one block."""
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class ComputedPrefix(msgspec.Struct, frozen=True):
    """Blocks (per group) already holding a request's leading tokens."""

    blocks: tuple[tuple[int, ...], ...]
    num_tokens: int
    fillable_tokens: int = 0
    """Tokens after ``num_tokens`` (a multiple of the hash unit) that every prefix-cacheable group holds but
    the ones a KV connector fills: what it may load into those groups (:meth:`KVCacheManager.filled`)."""
    fillable_blocks: tuple[tuple[int, ...], ...] = ()
    """Per group, its blocks of those tokens (empty for the filled groups and the groups that are not looked up)."""


class KVCacheManager:
    """Allocates, shares and frees KV-cache blocks of every group for every request."""

    def __init__(
        self, groups: Sequence[KVCacheGroupSpec], num_blocks: Sequence[int], enable_prefix_caching: bool = True
    ):
        if len(groups) != len(num_blocks):
            raise ValueError(f"{len(groups)} KV-cache groups but {len(num_blocks)} block counts")
        self.groups = tuple(groups)
        self.pools = tuple(BlockPool(count) for count in num_blocks)
        self.prefix_caching = enable_prefix_caching and all(
            group.prefix_cacheable or group.checkpointed for group in self.groups
        )
        self._hash_unit = lcm(*(group.spec.block_size for group in self.groups))
        self._blocks: dict[str, list[list[int]]] = {}
        self._hashes: dict[str, list[list[bytes]]] = {}
        self._lent: dict[tuple[int, int], LentBlock] = {}
        """(group, block) -> the request position it was lent from, until the pool hands it out or the request ends."""
        self._released: dict[str, set[tuple[int, int]]] = {}
        """Per request: (group, position) of its blocks already released to their pools (lent)."""
        self._reclaimed: list[LentBlock] = []
        self._without_snapshots: set[str] = set()
        """Requests whose state arrived by a transfer: their snapshot blocks were never written."""
        self.stats = PrefixCacheStats()

    def block_ids(self, request_id: str, group_ids: Sequence[int] | None = None) -> tuple[tuple[int, ...], ...]:
        """The request's blocks, per group (only ``group_ids`` when given: a connector's projection)."""
        blocks = self._blocks[request_id]
        chosen = range(len(self.groups)) if group_ids is None else group_ids
        return tuple(tuple(blocks[index]) for index in chosen)

    def holds(self, request_id: str) -> bool:
        """Whether the request holds blocks."""
        return request_id in self._blocks

    def usage(self) -> float:
        """Share of blocks held by requests, over all groups."""
        total = sum(pool.num_blocks for pool in self.pools)
        return 1 - sum(pool.num_free for pool in self.pools) / total

    def num_free_blocks(self) -> tuple[int, ...]:
        return tuple(pool.num_free for pool in self.pools)

    def find_computed_prefix(
        self, token_ids: Sequence[int], filled_groups: Sequence[int] = (), items: Sequence[BlockItem] = ()
    ) -> ComputedPrefix:
        """The longest cached prefix of ``token_ids`` (with its ``items``: :func:`block_hashes`) held in every group;
        no side effects.

        At least the last token is left to compute, because its logits are needed. ``filled_groups``: the
        groups a KV connector can fill (``KVConnector.fills_groups``); the prefix then also says how many tokens
        after it every other prefix-cacheable group holds (``fillable_tokens``).
        """
        empty = ComputedPrefix(blocks=tuple(() for _ in self.groups), num_tokens=0)
        if not self.prefix_caching or len(token_ids) <= 1:
            return empty
        usable = ((len(token_ids) - 1) // self._hash_unit) * self._hash_unit
        per_group: list[tuple[int, ...]] = []
        for group, pool in zip(self.groups, self.pools, strict=False):
            found = []
            cacheable = group.prefix_cacheable
            for block_hash in block_hashes(token_ids[:usable], group.spec.block_size, items=items) if cacheable else ():
                block = pool.lookup(block_hash)
                if block is None:
                    break
                found.append(block)
            per_group.append(tuple(found))
        num_tokens = self._held_by_all(per_group, ())
        blocks = tuple(
            found[: num_tokens // group.spec.block_size] for found, group in zip(per_group, self.groups, strict=False)
        )
        fillable = self._held_by_all(per_group, filled_groups) - num_tokens if filled_groups else 0
        if fillable <= 0:
            return ComputedPrefix(blocks=blocks, num_tokens=num_tokens)
        end = num_tokens + fillable
        fillable_blocks = tuple(
            () if index in filled_groups else found[num_tokens // group.spec.block_size : end // group.spec.block_size]
            for index, (found, group) in enumerate(zip(per_group, self.groups, strict=False))
        )
        return ComputedPrefix(
            blocks=blocks, num_tokens=num_tokens, fillable_tokens=fillable, fillable_blocks=fillable_blocks
        )

    def _held_by_all(self, per_group: list[tuple[int, ...]], skipped: Sequence[int]) -> int:
        """Tokens (a multiple of the hash unit) whose blocks every prefix-cacheable group not ``skipped`` found."""
        held = [
            len(found) * group.spec.block_size
            for index, (found, group) in enumerate(zip(per_group, self.groups, strict=False))
            if group.prefix_cacheable and index not in skipped
        ]
        return (min(held, default=0) // self._hash_unit) * self._hash_unit

    def filled(self, prefix: ComputedPrefix, num_tokens: int) -> ComputedPrefix:
        """``prefix`` extended by the first ``num_tokens`` of its fillable tokens, which a KV connector loads into
        the groups it fills: the other groups share their cached blocks of them. ``num_tokens`` is a multiple of
        the hash unit (:meth:`fillable_unit`), at most ``prefix.fillable_tokens``."""
        if num_tokens == 0:
            return prefix
        if num_tokens % self._hash_unit or not 0 < num_tokens <= prefix.fillable_tokens:
            raise ValueError(
                f"{num_tokens} tokens cannot extend a prefix hit of {prefix.num_tokens} tokens: at most "
                f"{prefix.fillable_tokens} are fillable, in multiples of {self._hash_unit}"
            )
        blocks = tuple(
            shared + more[: num_tokens // group.spec.block_size]
            for shared, more, group in zip(prefix.blocks, prefix.fillable_blocks, self.groups, strict=False)
        )
        return ComputedPrefix(blocks=blocks, num_tokens=prefix.num_tokens)

    @property
    def fillable_unit(self) -> int:
        """Tokens a filled prefix grows by at a time: a block of every group."""
        return self._hash_unit

    def allocate_slots(
        self, request_id: str, num_tokens: int, prefix: ComputedPrefix | None = None, prompt_length: int = 0
    ) -> bool:
        """Make the request hold blocks for its first ``num_tokens`` tokens in every group.

        The first call for a request may pass the ``prefix`` found for it, and its
        ``prompt_length`` to count the lookup in :attr:`stats` (0: don't count). Returns False, changing
        nothing, when a group has too few free blocks; the scheduler then
        preempts or waits.
        """
        held = self._blocks.get(request_id)
        new_request = held is None
        if not new_request and all(
            len(blocks) >= group.spec.blocks_for_tokens(num_tokens)
            for group, blocks in zip(self.groups, held, strict=False)
        ):
            return True  # a decode step inside blocks it already holds: the common case, kept cheap
        held = held or [[] for _ in self.groups]
        reused = prefix.blocks if (new_request and prefix is not None) else tuple(() for _ in self.groups)
        needed = []
        for group, pool, blocks, shared in zip(self.groups, self.pools, held, reused, strict=False):
            missing = group.spec.blocks_for_tokens(num_tokens) - len(blocks) - len(shared)
            idle_shared = sum(1 for block in shared if pool.is_idle(block))
            if max(missing, 0) + idle_shared > pool.num_free:
                return False
            needed.append(max(missing, 0))
        for pool, blocks, shared, count in zip(self.pools, held, reused, needed, strict=False):
            for block in shared:
                pool.touch(block)
            blocks.extend(shared)
            blocks.extend(self._take(pool) for _ in range(count))
        if new_request:
            self._blocks[request_id] = held
            self._hashes[request_id] = [[] for _ in self.groups]
            self._released[request_id] = set()
        if new_request and prompt_length:
            cached = prefix.num_tokens if prefix is not None else 0
            self.stats.queries += 1
            self.stats.query_tokens += prompt_length
            self.stats.hit_tokens += cached
            self.stats.hits += cached > 0
        return True

    def _take(self, pool: BlockPool) -> int:
        block = pool.take()
        lent = self._lent.pop((self.pools.index(pool), block), None)
        if lent is not None:
            self._reclaimed.append(lent)
        return block

    def lend(self, lent: LentBlock) -> None:
        """Release one of a running request's blocks to its pool; the request keeps it in its list
        (and may read it) until the pool hands it out again. Lending a block twice changes nothing."""
        released = self._released.get(lent.request_id)
        if released is None or (lent.group, lent.position) in released:
            return
        block = self._blocks[lent.request_id][lent.group][lent.position]
        released.add((lent.group, lent.position))
        self._lent[(lent.group, block)] = lent
        self.pools[lent.group].release(block)

    def reclaimed(self) -> tuple[LentBlock, ...]:
        """Lent blocks the pools handed out again since the last call."""
        reclaimed, self._reclaimed = tuple(self._reclaimed), []
        return reclaimed

    def forgo_snapshots(self, request_id: str) -> None:
        """The request's state arrived by a transfer without its snapshots: never publish its
        snapshot (:class:`CheckpointSpec`) blocks, so no later hit can end in its prefix."""
        self._without_snapshots.add(request_id)

    def cache_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, items: Sequence[BlockItem] = ()
    ) -> list[tuple[int, int, bytes]]:
        """Publish the request's blocks that are now full and computed, so later requests can reuse them (``items``:
        the request's :func:`block_hashes` items); returns ``(group, block, hash)`` of each block published now (for
        :meth:`uncache`)."""
        published: list[tuple[int, int, bytes]] = []
        if not self.prefix_caching:
            return published
        for index, (group, pool) in enumerate(zip(self.groups, self.pools, strict=False)):
            if not group.prefix_cacheable:
                continue
            if request_id in self._without_snapshots and isinstance(group.spec, CheckpointSpec):
                continue
            size = group.spec.block_size
            known = self._hashes[request_id][index]
            done, full = len(known), num_computed_tokens // size
            if full <= done:
                continue
            hashes = block_hashes(token_ids[: full * size], size, known, items)
            blocks = self._blocks[request_id][index]
            for position in range(done, full):
                if pool.cache(blocks[position], hashes[position]):
                    published.append((index, blocks[position], hashes[position]))
            self._hashes[request_id][index] = hashes
        return published

    def uncache(self, published: Sequence[tuple[int, int, bytes]]) -> None:
        """Unpublish blocks :meth:`cache_blocks` published whose contents were never written (the step that was to
        compute them failed); any still holding them keeps them, its own copy."""
        for group, block, block_hash in published:
            self.pools[group].uncache(block, block_hash)

    def free(self, request_id: str) -> None:
        """Release the request's blocks; cached ones stay reusable until evicted. Idempotent."""
        blocks = self._blocks.pop(request_id, None)
        self._hashes.pop(request_id, None)
        released = self._released.pop(request_id, set())
        self._without_snapshots.discard(request_id)
        if blocks is None:
            return
        for group, (pool, group_blocks) in enumerate(zip(self.pools, blocks, strict=False)):
            for position in range(len(group_blocks) - 1, -1, -1):
                block = group_blocks[position]
                if (group, position) not in released:
                    pool.release(block)
                elif self._lent.get((group, block), None) == LentBlock(request_id, group, position):
                    del self._lent[(group, block)]  # not handed out again: no reclaim to report for an ended request
