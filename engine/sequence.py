"""One generated choice of a request: its tokens, its blocks, its progress."""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING

from engine.block_hash import block_hashes, chain_salt, hash_block, root_hash

if TYPE_CHECKING:
    from engine.request import GenerationRequest
    from engine.sampling import SequenceSampler


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids (prompt + output), the blocks holding their KV, and how many are computed.

    ``num_computed`` tokens have KV in the pool; the leading ``num_published``
    blocks are in the pool's prefix cache (acquired from it or published to it).
    A preempted sequence drops its blocks and recomputes prompt + output so far.
    """

    def __init__(self, seq_id: int, request: "GenerationRequest", index: int, block_size: int, salt: str) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.block_size = block_size
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed = 0
        self.block_table: list[int] = []
        self.num_published = 0
        self.status = Status.WAITING
        self.wait_order = 0  # its place among the waiting (engine.scheduler.WaitQueue)
        self.finish_reason: str | None = None
        # Prefix-cache hit of the first admission (what usage reports).
        self.cached_tokens: int | None = None
        self.first_scheduled: float | None = None
        self.sampler: SequenceSampler | None = None
        # Sibling choices (n > 1) that start once this one has computed the prompt.
        self.forks: list[Sequence] = []
        # The prompt's block keys are exactly what the router computes.
        self._extra = _extra_by_block(request.mm_hashes, block_size)
        salt = chain_salt(salt, request.cache_salt)
        self.block_keys: list[int] = block_hashes(self.token_ids, block_size, salt, request.mm_hashes)
        self._root = root_hash(salt)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.num_tokens % self.block_size == 0:
            # A block just filled with known tokens: extend the hash chain.
            index = len(self.block_keys)
            start = index * self.block_size
            parent = self.block_keys[-1] if self.block_keys else self._root
            self.block_keys.append(
                hash_block(parent, self.token_ids[start : start + self.block_size], self._extra.get(index, ()))
            )

    def blocks_needed(self, num_new_tokens: int) -> int:
        total = self.num_computed + num_new_tokens
        return max(0, -(-total // self.block_size) - len(self.block_table))

    def cacheable_prefix_keys(self) -> list[int]:
        """Keys a cache hit may cover: never the block holding the last token,
        which must be computed to get the logits of the next one."""
        return self.block_keys[: (self.num_tokens - 1) // self.block_size]

    def reset_for_recompute(self) -> None:
        self.num_computed = 0
        self.block_table = []
        self.num_published = 0
        self.status = Status.WAITING


def _extra_by_block(mm_hashes, block_size: int) -> dict[int, list[bytes]]:
    extra: dict[int, list[bytes]] = {}
    for offset, content in mm_hashes:
        extra.setdefault(offset // block_size, []).append(content)
    return extra
