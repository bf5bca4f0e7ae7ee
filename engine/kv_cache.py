"""KV tensors owned by the engine, indexed by the block pool's physical block ids.

Each tier is one tensor ``[layers, 2 (k, v), blocks, block_size, kv_heads, head_dim]``
so that moving a block between tiers is one copy for all layers; ``key(layer)``
and ``value(layer)`` are the per-layer ``[blocks, block_size, kv_heads, head_dim]``
views the attention function reads and writes.  Block ids ``>= num_device``
belong to the host tier (index ``id - num_device``), as in ``BlockPool``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import memory

# On CPU the "device" tier is ordinary RAM shared with everything else on the
# machine: take this share of what is available for both tiers together, at
# most CPU_KV_CAP_BYTES, so a laptop or a shared CI box is not pushed into swap.
CPU_KV_FRACTION = 0.15
CPU_KV_CAP_BYTES = 2 << 30
# With a GPU the host tier is pinned RAM, which the kernel can neither swap nor
# reclaim: at most this share of what is available, however large the device
# tier (3x a 125 GB H200 tier would ask for 375 GB).  Inside a container with a
# memory limit, which was set for this process, a larger share of its room.
HOST_KV_FRACTION = 0.25
HOST_KV_FRACTION_OF_LIMIT = 0.75


@dataclass(slots=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_model_config(cls, config, block_size: int, dtype: torch.dtype) -> "KVShape":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, block_size, dtype)


def size_device_blocks(
    shape: KVShape, device: torch.device, fraction: float, host_multiplier: float, max_blocks: int | None = None
) -> int:
    """Device blocks that fit in ``fraction`` of free memory (vLLM's gpu_memory_utilization).

    On CPU, also at most ``max_blocks``: the device tier is zeroed RAM, and a
    tiny model would otherwise get hundreds of thousands of blocks it never uses.
    """
    per_block = shape.bytes_per_block
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return max(1, int(free * fraction) // per_block)
    # Both tiers live in RAM on CPU, so the budget covers them together.
    budget = min(memory.available_ram() * CPU_KV_FRACTION * fraction, CPU_KV_CAP_BYTES)
    blocks = int(budget // (per_block * (1 + host_multiplier)))
    return max(1, min(blocks, max_blocks) if max_blocks else blocks)


def size_host_blocks(shape: KVShape, device: torch.device, device_blocks: int, host_multiplier: float) -> tuple[int, bool]:
    """Host-tier blocks: ``host_multiplier`` times the device tier; with a GPU at
    most HOST_KV_FRACTION of available RAM.  Also whether that cap applied."""
    wanted = int(device_blocks * host_multiplier)
    if device.type != "cuda":
        return wanted, False  # size_device_blocks' budget already covers both tiers
    # torch's pinned-memory allocator rounds each allocation up to a power of two:
    # the tier must stay within the largest power of two under the cap to stay under it.
    room = memory.cgroup_room()
    if room is None:
        cap_bytes = int(memory.available_ram() * HOST_KV_FRACTION)
    else:
        cap_bytes = int(min(memory.available_ram(), room) * HOST_KV_FRACTION_OF_LIMIT)
    cap = (1 << (cap_bytes.bit_length() - 1)) // shape.bytes_per_block if cap_bytes > 0 else 0
    return min(wanted, cap), wanted > cap


class KVCache:
    def __init__(self, shape: KVShape, device_blocks: int, host_blocks: int, device: torch.device) -> None:
        self.shape = shape
        self.num_device = device_blocks
        self.num_host = host_blocks
        self.device = device
        dims = (shape.num_layers, 2, 0, shape.block_size, shape.num_kv_heads, shape.head_dim)
        # Zeroed, not empty: the batched decode gathers padding slots and masks
        # them; a NaN bit pattern there would still poison the softmax-weighted sum.
        self.device_kv = torch.zeros(_with_blocks(dims, device_blocks), dtype=shape.dtype, device=device)
        # Host blocks are only read after a demotion wrote them whole.
        self.host_kv = torch.empty(
            _with_blocks(dims, host_blocks),
            dtype=shape.dtype,
            device="cpu",
            pin_memory=device.type == "cuda" and host_blocks > 0,
        )
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def key(self, layer: int) -> torch.Tensor:
        return self.device_kv[layer, 0]

    def value(self, layer: int) -> torch.Tensor:
        return self.device_kv[layer, 1]

    def apply_copies(self, copies: list[tuple[int, int]]) -> None:
        """Run BlockPool.drain_copies() in order (a later copy may reuse an earlier source)."""
        num_device = self.num_device
        per_block = self.shape.bytes_per_block
        for src, dst in copies:
            if src < num_device <= dst:
                self.host_kv[:, :, dst - num_device].copy_(self.device_kv[:, :, src], non_blocking=False)
                self.bytes_to_host += per_block
            elif dst < num_device <= src:
                self.device_kv[:, :, dst].copy_(self.host_kv[:, :, src - num_device], non_blocking=True)
                self.bytes_to_device += per_block
            elif src < num_device and dst < num_device:
                self.device_kv[:, :, dst].copy_(self.device_kv[:, :, src])
            else:
                self.host_kv[:, :, dst - num_device].copy_(self.host_kv[:, :, src - num_device])

    def block(self, block: int) -> torch.Tensor:
        """A block's KV for all layers (a copy), from whichever tier holds it; for tests."""
        if block < self.num_device:
            return self.device_kv[:, :, block].clone()
        return self.host_kv[:, :, block - self.num_device].clone()


def _with_blocks(dims: tuple[int, ...], blocks: int) -> tuple[int, ...]:
    return dims[:2] + (blocks,) + dims[3:]
