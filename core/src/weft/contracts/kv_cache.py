"""KV-cache specs: what one KV-cache group stores, and what may be done with it.

A model declares one :class:`KVCacheGroupSpec` per group of layers that share a
cache layout (a Llama model has one group; DeepSeek V3 one of latent entries; DeepSeek V4
has five: a sliding window ring, CSA compressed KV, HCA compressed KV, indexer keys and the
compressor's recurrent state). The KV-cache manager allocates blocks per group,
and two flags tell the rest of the system what is safe:

``prefix_cacheable``
    blocks hold a pure function of the token prefix they cover, so they may be
    reused by another request with the same prefix and stored in a prefix store
    (a KV connector such as MooncakeStore).
``transferable``
    blocks may be copied to another instance serving the *same* request
    (prefill/decode disaggregation). A ring or recurrent group is transferable
    but not prefix-cacheable: "transferable is not storable".

A ring or recurrent group may still take part in prefix caching when its model checkpoints it
(:class:`CheckpointSpec`, :attr:`KVCacheGroupSpec.checkpointed`).

Callers that move blocks pick the groups by these flags
(:func:`prefix_cacheable_groups`, :func:`transferable_groups`) instead of
assuming that every group may go everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}


def dtype_size(dtype: str) -> int:
    """Bytes per element of a torch dtype given by name."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown KV-cache dtype {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}") from None


class KVCacheSpec(msgspec.Struct, frozen=True, tag_field="kind"):
    """Base of every spec: how many tokens a block covers and its element type."""

    block_size: int
    """Tokens covered by one block (for compressed groups: source tokens, not entries)."""
    dtype: str
    """torch dtype name of the stored elements."""

    @property
    def prefix_cacheable(self) -> bool:
        raise NotImplementedError

    @property
    def transferable(self) -> bool:
        return True

    def page_size_bytes(self) -> int:
        """Bytes of one block across all layers of one group member (one layer)."""
        raise NotImplementedError

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a request holding ``num_tokens`` tokens needs in this group."""
        return -(-num_tokens // self.block_size)

    @property
    def paged_attention(self) -> bool:
        """Whether the attention backend owns this group's layout and attends over it (plain paged K/V).

        Other groups (compressed entries, recurrent state, rings) belong to the model that declares
        them: its family gives their tensor shape (:meth:`ModelFamily.kv_cache_shape`) and reads them.
        """
        return False

    def slot_mapping(self, block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The cache slot (``block * block_size + offset``) of the token at each position.

        ``block_table`` is ``[num_reqs, max_blocks]``, ``rows`` the request row of each token.
        """
        size = self.block_size
        return block_table[rows, positions // size].long() * size + positions % size


class FullAttentionSpec(KVCacheSpec, frozen=True, tag="full_attention"):
    """Keys and values of every token: grows with the sequence; prefix-cacheable."""

    num_kv_heads: int
    head_dim: int

    @property
    def prefix_cacheable(self) -> bool:
        return True

    @property
    def paged_attention(self) -> bool:
        return True

    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * dtype_size(self.dtype)


class SlidingWindowSpec(KVCacheSpec, frozen=True, tag="sliding_window"):
    """Keys and values of the last ``window`` tokens.

    Blocks wholly outside the window may be freed. Whether it is prefix-cacheable
    depends on the storage: ``ring=True`` overwrites slots in place, so a block's
    contents are not a function of one prefix and must never be reused.

    A ring holds at most :attr:`ring_blocks` blocks; the token at position ``p``
    lives in the request's block ``(p // block_size) % ring_blocks``, so the last
    ``window`` tokens before a step are still there while the step writes its own.
    Attention backends run only non-ring windows; a ring belongs to the model.
    """

    num_kv_heads: int
    head_dim: int
    window: int
    ring: bool = False

    @property
    def prefix_cacheable(self) -> bool:
        return not self.ring

    @property
    def paged_attention(self) -> bool:
        return not self.ring

    @property
    def ring_blocks(self) -> int:
        return -(-self.window // self.block_size) + 1

    def blocks_for_tokens(self, num_tokens: int) -> int:
        if self.ring:
            return min(super().blocks_for_tokens(num_tokens), self.ring_blocks)
        return super().blocks_for_tokens(num_tokens)

    def slot_mapping(self, block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.ring:
            return super().slot_mapping(block_table, rows, positions)
        size = self.block_size
        return block_table[rows, (positions // size) % self.ring_blocks].long() * size + positions % size

    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * dtype_size(self.dtype)


class CompressedSpec(KVCacheSpec, frozen=True, tag="compressed"):
    """One entry per ``compress_ratio`` source tokens (DeepSeek V4 CSA/HCA, indexer keys).

    A block covers ``block_size`` source tokens, so it holds
    ``block_size // compress_ratio`` entries of ``entry_dim`` elements. Entries
    are pure functions of their prefix, so blocks are prefix-cacheable.
    """

    compress_ratio: int
    entry_dim: int

    def __post_init__(self) -> None:
        if self.block_size % self.compress_ratio:
            raise ValueError(
                f"CompressedSpec: block_size {self.block_size} must be a multiple of "
                f"compress_ratio {self.compress_ratio}"
            )

    @property
    def prefix_cacheable(self) -> bool:
        return True

    def page_size_bytes(self) -> int:
        return (self.block_size // self.compress_ratio) * self.entry_dim * dtype_size(self.dtype)

    def slot_mapping(self, block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The entry slot each token contributes to (written when the token completes its window)."""
        size, per_block = self.block_size, self.block_size // self.compress_ratio
        return block_table[rows, positions // size].long() * per_block + (positions % size) // self.compress_ratio


class LatentAttentionSpec(KVCacheSpec, frozen=True, tag="latent_attention"):
    """Multi-head latent attention (DeepSeek V2/V3): one entry per token shared by every head, the compressed
    key/value latent (``kv_lora_rank``) followed by the rotated key part (``qk_rope_head_dim``).

    Where plain attention stores ``2 * heads * head_dim`` elements a token, this stores ``entry_dim``
    (576 for DeepSeek V3 against 2 * 128 * 192 expanded). Entries are pure functions of their prefix,
    so blocks are prefix-cacheable; the model that declares the group attends over it.
    """

    entry_dim: int

    @property
    def prefix_cacheable(self) -> bool:
        return True

    def page_size_bytes(self) -> int:
        return self.block_size * self.entry_dim * dtype_size(self.dtype)


class RecurrentStateSpec(KVCacheSpec, frozen=True, tag="recurrent_state"):
    """A fixed-size state per request, overwritten each step (a compressor's partial window).

    It always takes one block whatever the length, it is not prefix-cacheable
    (the state after a prefix is not kept once more tokens arrive), and it is
    transferable to a decode instance serving the same request.
    """

    state_elements: int

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return 1

    def page_size_bytes(self) -> int:
        return self.state_elements * dtype_size(self.dtype)

    def slot_mapping(self, block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The request's one state block, for every token."""
        return block_table[rows, 0].long()


class CheckpointSpec(KVCacheSpec, frozen=True, tag="checkpoint"):
    """Snapshots of a model's own state (a window ring, a recurrent state) as it stands after each
    full block: block ``k`` holds the state after tokens ``0 .. (k + 1) * block_size - 1``.

    A snapshot is a pure function of the prefix it ends, so these blocks are prefix-cacheable;
    they are what lets the groups marked :attr:`KVCacheGroupSpec.checkpointed` take part in
    prefix caching. The model writes one whenever a step crosses a block boundary and, on the
    step after a prefix hit (:attr:`weft.layers.attention.ForwardContext.prefix_hits`), restores
    the checkpointed groups from the snapshot at the hit's end.
    """

    state_elements: int
    """Elements of one layer's snapshot."""

    @property
    def prefix_cacheable(self) -> bool:
        return True

    @property
    def transferable(self) -> bool:
        """A snapshot serves the instance's own prefix cache (and a prefix store); a prefill/decode
        transfer moves the checkpointed state itself, so a decode instance needs none (it neither
        restores the transferred request from snapshots nor publishes its snapshot blocks)."""
        return False

    def page_size_bytes(self) -> int:
        return self.state_elements * dtype_size(self.dtype)

    def slot_mapping(self, block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The snapshot block each token's position falls in."""
        return block_table[rows, positions // self.block_size].long()


class KVCacheGroupSpec(msgspec.Struct, frozen=True):
    """A named group of layers sharing one spec; the KV-cache manager keeps one block table per group."""

    name: str
    layer_names: tuple[str, ...]
    spec: (
        FullAttentionSpec
        | SlidingWindowSpec
        | CompressedSpec
        | LatentAttentionSpec
        | RecurrentStateSpec
        | CheckpointSpec
    )
    checkpointed: bool = False
    """For a group that is not prefix-cacheable: its model restores it, after a prefix hit, from a
    :class:`CheckpointSpec` group it also declares, so prefix caching may stay on (added in core API 1.5)."""

    @property
    def prefix_cacheable(self) -> bool:
        return self.spec.prefix_cacheable

    @property
    def transferable(self) -> bool:
        return self.spec.transferable


def prefix_cacheable_groups(groups: list[KVCacheGroupSpec] | tuple[KVCacheGroupSpec, ...]) -> tuple[int, ...]:
    """Indices of the groups whose blocks may be reused across requests or stored."""
    return tuple(i for i, group in enumerate(groups) if group.prefix_cacheable)


def transferable_groups(groups: list[KVCacheGroupSpec] | tuple[KVCacheGroupSpec, ...]) -> tuple[int, ...]:
    """Indices of the groups whose blocks may be sent to another instance serving the same request."""
    return tuple(i for i, group in enumerate(groups) if group.transferable)
