"""Block identity shared by the engine and the router.

A block's hash chains its parent's hash with the block's token ids and any
extra keys (content hashes of multimodal inputs that start inside the block).
The chain is seeded by a salt (model name, adapter) so two models never share
block identity, and optionally by a request's cache salt (vLLM's ``cache_salt``;
kvgate salts each tenant's requests), so that prompts of different salts never
share blocks and one tenant cannot learn from cache hits what another sent.  The router imports this module and nothing else for hashing,
so both sides agree bit for bit.
"""

from __future__ import annotations

import functools
import struct
from typing import Iterable, Sequence

import xxhash

DEFAULT_BLOCK_SIZE = 16

_ROOT_TAG = b"kvgate.v1"


def chain_salt(salt: str | bytes, cache_salt: str | None) -> str | bytes:
    """The salt of a request's chain: the model's, joined with the request's cache salt if any."""
    if not cache_salt:
        return salt
    if isinstance(salt, str):
        salt = salt.encode()
    return salt + b"\x00cache_salt\x00" + cache_salt.encode("utf-8", "surrogatepass")


@functools.lru_cache(maxsize=4096)
def root_hash(salt: str | bytes = b"") -> int:
    """The parent hash of a prompt's first block."""
    if isinstance(salt, str):
        salt = salt.encode()
    return xxhash.xxh3_64_intdigest(_ROOT_TAG + salt)


def hash_block(parent: int, token_ids: Sequence[int], extra_keys: Iterable[bytes] = ()) -> int:
    """64-bit hash of one block: (parent hash, token ids, extra keys).

    The hashed bytes: the parent as 8 little-endian bytes, each token id as 4,
    then each extra key prefixed by its length (4 bytes, so (b"ab", b"c") and
    (b"a", b"bc") differ).  A fixed encoding: the same value on every machine.
    """
    return xxhash.xxh3_64_intdigest(
        parent.to_bytes(8, "little") + struct.pack(f"<{len(token_ids)}I", *token_ids) + _extra_bytes(extra_keys)
    )


def _extra_bytes(extra_keys: Iterable[bytes]) -> bytes:
    return b"".join(len(key).to_bytes(4, "little") + key for key in extra_keys)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    salt: str | bytes = b"",
    mm_inputs: Sequence[tuple[int, bytes]] = (),
) -> list[int]:
    """Chained hashes of the *full* blocks of a prompt (``hash_block`` down the chain).

    ``mm_inputs`` lists (token offset, content hash) of multimodal inputs; each
    joins the extra keys of the block its placeholder starts in.  The trailing
    partial block has no hash: it cannot be shared until it is full.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    extra_by_block: dict[int, list[bytes]] = {}
    for offset, content in mm_inputs:
        extra_by_block.setdefault(offset // block_size, []).append(content)
    blocks = len(token_ids) // block_size
    # All the token bytes packed at once, then one hash call per block: this runs
    # for every request on the gateway and every admission in the engine.
    packed = struct.pack(f"<{blocks * block_size}I", *token_ids[: blocks * block_size])
    width = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    parent = root_hash(salt)
    hashes = []
    for index in range(blocks):
        data = parent.to_bytes(8, "little") + packed[index * width : (index + 1) * width]
        if extra_by_block:
            data += _extra_bytes(extra_by_block.get(index, ()))
        parent = digest(data)
        hashes.append(parent)
    return hashes


def content_hash(data: bytes) -> bytes:
    """Content key of a multimodal input (an image's bytes or its URL)."""
    return xxhash.xxh3_128_digest(data)
