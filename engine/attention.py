"""Attention over the engine's paged KV pool, plugged into transformers' models.

The runner packs every scheduled token of a step into one row (batch size 1,
``T`` tokens) and passes a ``PagedBatch`` as the extra forward keyword
``paged=``; transformers hands extra keywords down to the attention function
unchanged, together with ``module.layer_idx``.  The function writes the new
k/v into the pool by slot mapping, then attends over each sequence's context
gathered by block table:

- decode rows (one new token each) are batched into one SDPA call, padded to
  the longest context and masked by context length;
- a prefill chunk with no earlier context attends to its own k/v (causal);
- a prefill chunk after cached or earlier-chunk context gets an explicit mask:
  query i (position start+i) sees keys 0..start+i.

On CUDA, ``torch.nn.attention.varlen.varlen_attn`` with the block table does
it all in one call when the installed torch has it; any failure falls back to
the SDPA path for the rest of the process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ATTN_NAME = "kvgate_paged"

try:  # torch >= 2.10; CUDA only
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch
    varlen_attn = None

_varlen_ok = varlen_attn is not None


@dataclass(slots=True)
class PrefillItem:
    token_start: int  # index of the chunk's first token in the packed row
    num_tokens: int
    context_start: int  # tokens of this sequence already in the pool before the chunk
    blocks: torch.Tensor | None  # block ids covering context_start + num_tokens (None: no context)
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, None when context_start == 0


@dataclass(slots=True)
class PagedBatch:
    """Per-step metadata, built once per step by the runner and shared by all layers."""

    kv: object  # engine.kv_cache.KVCache
    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of every new token
    decode_index: torch.Tensor | None = None  # [B] rows of one-token sequences
    decode_blocks: torch.Tensor | None = None  # [B, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size]
    prefills: list[PrefillItem] = field(default_factory=list)
    # varlen (CUDA) form of the whole step
    cu_seq_q: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0


def paged_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: q [1, H, T, D], k/v [1, KVH, T, D] -> ([1, T, H, D], None)."""
    batch: PagedBatch | None = kwargs.get("paged")
    if batch is None:
        raise RuntimeError(f"{ATTN_NAME} attention needs the engine's `paged=` metadata")
    layer = module.layer_idx
    k_cache, v_cache = batch.kv.key(layer), batch.kv.value(layer)
    new_k = key[0].transpose(0, 1)  # [T, KVH, D]
    new_v = value[0].transpose(0, 1)
    heads, dim = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, heads, dim).index_copy_(0, batch.slot_mapping, new_k.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, batch.slot_mapping, new_v.to(v_cache.dtype))
    if query.is_cuda and batch.block_table is not None and _varlen_ok:
        out = _varlen(query, k_cache, v_cache, batch, scaling)
        if out is not None:
            return out.unsqueeze(0), None
    return _sdpa(query, new_k, new_v, k_cache, v_cache, batch, scaling).unsqueeze(0), None


def _sdpa(query, new_k, new_v, k_cache, v_cache, batch: PagedBatch, scaling) -> torch.Tensor:
    q = query[0]  # [H, T, D]
    out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, H, D]
    if batch.decode_index is not None:
        rows = batch.decode_index
        b = rows.shape[0]
        k = _gather(k_cache, batch.decode_blocks).transpose(1, 2)  # [B, KVH, L, D]
        v = _gather(v_cache, batch.decode_blocks).transpose(1, 2)
        qd = q[:, rows].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=batch.decode_mask, scale=scaling, enable_gqa=True)
        out[rows] = o.view(b, q.shape[0], q.shape[2])
    for item in batch.prefills:
        start, end = item.token_start, item.token_start + item.num_tokens
        qp = q[:, start:end].unsqueeze(0)  # [1, H, n, D]
        if item.context_start == 0:
            # The chunk is the whole context so far: its own k/v, plain causal.
            k = new_k[start:end].transpose(0, 1).unsqueeze(0)
            v = new_v[start:end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            length = item.context_start + item.num_tokens
            k = _gather(k_cache, item.blocks[None])[:, :length].transpose(1, 2)
            v = _gather(v_cache, item.blocks[None])[:, :length].transpose(1, 2)
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=item.mask, scale=scaling, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[B, nblocks] block ids -> [B, nblocks * block_size, KVH, D] contiguous context."""
    b, n = blocks.shape
    return cache[blocks.reshape(-1)].view(b, n * cache.shape[1], cache.shape[2], cache.shape[3])


def _varlen(query, k_cache, v_cache, batch: PagedBatch, scaling) -> torch.Tensor | None:
    """One flash-attention call over the pool; None (and SDPA from then on) if unsupported."""
    global _varlen_ok
    q = query[0].transpose(0, 1)  # [T, H, D]
    try:
        return varlen_attn(
            q,
            k_cache,
            v_cache,
            batch.cu_seq_q,
            None,
            batch.max_q,
            batch.max_k,
            scale=scaling,
            window_size=(-1, 0),  # causal, aligned to the end of each context
            enable_gqa=True,
            seqused_k=batch.seq_lens,
            block_table=batch.block_table,
        )
    except Exception as exc:  # noqa: BLE001 - kernel constraints vary by build and GPU
        log.warning("varlen_attn with a block table is unavailable (%s); using SDPA over gathered blocks", exc)
        _varlen_ok = False
        return None


def register() -> str:
    """Register the function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    return ATTN_NAME


def use_paged_attention(model) -> None:
    """Switch a loaded model to the paged attention function."""
    name = register()
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter(name)
            return
        except Exception:  # noqa: BLE001 - older checks reject custom names; the attribute works
            pass
    model.config._attn_implementation = name
