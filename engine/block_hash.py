"""Block identity shared by the engine and the router.

A block's hash chains its parent's hash with the block's token ids and any
extra keys (content hashes of multimodal inputs that start inside the block).
The chain is seeded by a salt (model name, adapter) so two models never share
block identity.  The router imports this module and nothing else for hashing,
so both sides agree bit for bit.
"""

from __future__ import annotations

import struct
from typing import Iterable, Sequence

import xxhash

DEFAULT_BLOCK_SIZE = 16

_ROOT_TAG = b"kvgate.v1"


def root_hash(salt: str | bytes = b"") -> int:
    """The parent hash of a prompt's first block."""
    if isinstance(salt, str):
        salt = salt.encode()
    return xxhash.xxh3_64_intdigest(_ROOT_TAG + salt)


def hash_block(parent: int, token_ids: Sequence[int], extra_keys: Iterable[bytes] = ()) -> int:
    """64-bit hash of one block: (parent hash, token ids, extra keys).

    Fixed little-endian encoding makes the value identical on every machine.
    """
    h = xxhash.xxh3_64()
    h.update(parent.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    for key in extra_keys:
        # Length-prefixed so (b"ab", b"c") and (b"a", b"bc") differ.
        h.update(len(key).to_bytes(4, "little"))
        h.update(key)
    return h.intdigest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    salt: str | bytes = b"",
    mm_inputs: Sequence[tuple[int, bytes]] = (),
) -> list[int]:
    """Chained hashes of the *full* blocks of a prompt.

    ``mm_inputs`` lists (token offset, content hash) of multimodal inputs; each
    joins the extra keys of the block its placeholder starts in.  The trailing
    partial block has no hash: it cannot be shared until it is full.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    extra_by_block: dict[int, list[bytes]] = {}
    for offset, content in mm_inputs:
        extra_by_block.setdefault(offset // block_size, []).append(content)
    parent = root_hash(salt)
    hashes = []
    for index in range(len(token_ids) // block_size):
        start = index * block_size
        parent = hash_block(parent, token_ids[start : start + block_size], extra_by_block.get(index, ()))
        hashes.append(parent)
    return hashes


def content_hash(data: bytes) -> bytes:
    """Content key of a multimodal input (an image's bytes or its URL)."""
    return xxhash.xxh3_128_digest(data)
