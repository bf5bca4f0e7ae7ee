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

On CUDA, ``torch.nn.attention.varlen.varlen_attn`` does it all in one call
when the installed torch has it: first with the block table (paged flash
attention; some builds require pages of 256 tokens), else over the context
gathered into one packed tensor; if both fail, SDPA as on CPU.  The first
failure of a form disables it for the rest of the process.
"""

from __future__ import annotations

import itertools
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

_varlen_ok = varlen_attn is not None  # any varlen form still worth trying
_varlen_paged_ok = _varlen_ok  # the block-table form


@dataclass(slots=True)
class PrefillItem:
    token_start: int  # index of the chunk's first token in the packed row
    num_tokens: int
    context_start: int  # tokens of this sequence already in the pool before the chunk
    blocks: torch.Tensor | None  # block ids covering context_start + num_tokens (None: no context)
    mask: torch.Tensor | None  # [1, 1, num_tokens, context_len] bool, None when context_start == 0
    grouped_mask: torch.Tensor | None = None  # mask tiled for folded query heads, made by layer 0


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
    cu_seq_k: torch.Tensor | None = None
    context_slots: torch.Tensor | None = None  # [sum of context lens] slots, sequence after sequence
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
    if batch.block_table is not None and _varlen_ok:  # the runner builds it on CUDA only
        out = _varlen(query, k_cache, v_cache, batch, scaling)
        if out is not None:
            return out.unsqueeze(0), None
    return _sdpa(query, new_k, new_v, k_cache, v_cache, batch, scaling).unsqueeze(0), None


def _sdpa(query, new_k, new_v, k_cache, v_cache, batch: PagedBatch, scaling) -> torch.Tensor:
    """SDPA per group of rows.

    Where a mask is needed, the query heads sharing a kv head are folded into
    the query-length axis instead of using enable_gqa: the same math, but
    CPU SDPA with a mask and enable_gqa takes a slow path (bf16: 15 ms vs 3 ms
    for a 16-row decode with 320 context tokens, measured here).
    """
    q = query[0]  # [H, T, D]
    heads, dim = q.shape[0], q.shape[2]
    kv_heads = k_cache.shape[-2]
    group = heads // kv_heads
    out = q.new_empty(q.shape[1], heads, dim)  # [T, H, D]
    if batch.decode_index is not None:
        rows = batch.decode_index
        b = rows.shape[0]
        k = _gather(k_cache, batch.decode_blocks).transpose(1, 2)  # [B, KVH, L, D]
        v = _gather(v_cache, batch.decode_blocks).transpose(1, 2)
        qd = q[:, rows].transpose(0, 1).reshape(b, kv_heads, group, dim)  # head h = kv_head * group + g
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=batch.decode_mask, scale=scaling)
        out[rows] = o.reshape(b, heads, dim)
    for item in batch.prefills:
        start, end = item.token_start, item.token_start + item.num_tokens
        if item.context_start == 0:
            # The chunk is the whole context so far: its own k/v, plain causal.
            qp = q[:, start:end].unsqueeze(0)  # [1, H, n, D]
            k = new_k[start:end].transpose(0, 1).unsqueeze(0)
            v = new_v[start:end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scaling, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
            continue
        n = item.num_tokens
        length = item.context_start + n
        k = _gather(k_cache, item.blocks[None])[:, :length].transpose(1, 2)  # [1, KVH, L, D]
        v = _gather(v_cache, item.blocks[None])[:, :length].transpose(1, 2)
        if item.grouped_mask is None:
            item.grouped_mask = item.mask.repeat(1, 1, group, 1)  # row g * n + i is query i
        qp = q[:, start:end].reshape(1, kv_heads, group * n, dim)
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=item.grouped_mask, scale=scaling)
        out[start:end] = o.reshape(heads, n, dim).transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[B, nblocks] block ids -> [B, nblocks * block_size, KVH, D] contiguous context."""
    b, n = blocks.shape
    return cache[blocks.reshape(-1)].view(b, n * cache.shape[1], cache.shape[2], cache.shape[3])


def _varlen(query, k_cache, v_cache, batch: PagedBatch, scaling) -> torch.Tensor | None:
    """One flash-attention call over the step; None when no varlen form works here."""
    global _varlen_ok, _varlen_paged_ok
    q = query[0].transpose(0, 1)  # [T, H, D]
    common = dict(scale=scaling, window_size=(-1, 0), enable_gqa=True)  # causal, aligned to each context's end
    if _varlen_paged_ok:
        try:
            return varlen_attn(
                q, k_cache, v_cache, batch.cu_seq_q, None, batch.max_q, batch.max_k,
                seqused_k=batch.seq_lens, block_table=batch.block_table, **common,
            )
        except Exception as exc:  # noqa: BLE001 - kernel constraints vary by build and GPU
            log.warning("varlen_attn with a block table unavailable (%s); gathering blocks instead", exc)
            _varlen_paged_ok = False
    heads, dim = k_cache.shape[-2], k_cache.shape[-1]
    try:
        k = k_cache.view(-1, heads, dim)[batch.context_slots]
        v = v_cache.view(-1, heads, dim)[batch.context_slots]
        return varlen_attn(q, k, v, batch.cu_seq_q, batch.cu_seq_k, batch.max_q, batch.max_k, **common)
    except Exception as exc:  # noqa: BLE001
        log.warning("varlen_attn unavailable (%s); using SDPA over gathered blocks", exc)
        _varlen_ok = False
        return None


def register() -> str:
    """Register the function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    return ATTN_NAME


# Settings a layer may hand its attention function that the paged function does
# not apply: answers with them would be silently wrong, so such models are refused.
_UNAPPLIED = {
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
}


# Layer kinds the paged attention computes; any other (conv, mamba, linear
# attention, a hybrid of both) carries state from step to step that the engine
# does not keep (each step is one packed forward with use_cache=False).
_ATTENTION_LAYERS = frozenset({"attention", "full_attention", "sliding_attention", "chunked_attention"})
# Rotary embeddings whose frequencies follow the longest position in the forward
# (transformers' dynamic_rope_update): in a packed step, every sequence's would
# follow the longest one's, and a prompt prefilled in chunks would change factors.
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def _unfit_by_config(config, max_model_len: int) -> str | None:
    """What the model's config asks for that the engine does not compute as the
    model does, or None.  Found in the config, as no two-token forward shows it:
    windows some layers apply through their mask alone (Qwen2-MoE, PhiMoE, Llama 4's
    chunks), layers with state besides attention (LFM2, Qwen3-Next, Jamba,
    Granite 4 hybrids), and LongRoPE or dynamic rope scaling past their original length."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = list(getattr(text, "layer_types", None) or [])
    kinds = set(layer_types) | set(getattr(text, "layers_block_type", None) or [])
    other = sorted(kinds - _ATTENTION_LAYERS)
    # mamba_* settings say so only where no layer kinds are named (Falcon-H1's
    # style); Granite 4's dense checkpoints carry them with every layer attention.
    if other or (not kinds and any(name.startswith("mamba_") for name in vars(text))):
        what = ", ".join(other) if other else "mamba"
        return (f"it has {what} layers besides attention, whose state from step to step the engine does not keep "
                "(a hybrid model)")
    windows = []
    sliding = getattr(text, "sliding_window", None)
    if sliding and ("sliding_attention" in kinds if layer_types else getattr(text, "use_sliding_window", True)):
        windows.append(("a sliding window", sliding))
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk and (not layer_types or "chunked_attention" in kinds):
        windows.append(("attention chunks", chunk))
    for what, size in windows:
        if size < max_model_len:
            return (f"some layers attend through {what} of {size} tokens, which the engine does not apply (it attends "
                    f"to the whole context): model.max_model_len at most {size} keeps every request inside it")
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    # One set of parameters, or one per layer type (Gemma 3's).
    for params in [p for p in rope.values() if isinstance(p, dict)] or [rope]:
        kind = params.get("rope_type", params.get("type"))
        if kind in _LENGTH_DEPENDENT_ROPE:
            # Where transformers switches factors: LongRoPE past its original length,
            # dynamic NTK past max_position_embeddings (it ignores any original length).
            original = (params.get("original_max_position_embeddings")
                        or getattr(text, "original_max_position_embeddings", None)) if kind == "longrope" else None
            original = original or getattr(text, "max_position_embeddings", None)
            if original and max_model_len > original:
                return (f"its {kind} rope scaling takes its factors from the longest position in a forward, which "
                        "in the engine's packed steps is another request's, or a prompt's chunk: "
                        f"model.max_model_len at most {original} (its original length) keeps to one set of factors")
    return None


def check_paged_attention(model, device: torch.device, max_model_len: int) -> None:
    """Refuse a model the paged attention cannot serve exactly (ConfigError on
    model.path): one whose layers never call transformers' attention interface
    (ALiBi models such as Bloom and MPT: their decode would see no context), drop
    the engine's ``paged=`` keyword on the way (Falcon: every step would fail),
    or ask for what it does not apply: a sliding window shorter than
    max_model_len, soft-capped logits, attention sinks (Gemma 2 and 3, gpt-oss,
    Mistral and Phi-3 past their windows), whose outputs would differ from the
    model's own.  Found by one forward of two tokens through a recording function."""
    from transformers import AttentionInterface

    from engine.config import ConfigError

    seen: dict = {}

    def probe(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
        seen[getattr(module, "layer_idx", len(seen))] = kwargs
        return query.transpose(1, 2), None  # [1, T, H, D], as the paged function returns

    sentinel = object()
    # A name of its own: the paged function stays as it is for engines already
    # serving in this process (a gateway's in-process replicas load side by side).
    name = f"{ATTN_NAME}_probe_{next(_probes)}"
    AttentionInterface.register(name, probe)
    _set_attention(model, name)
    try:
        with torch.inference_mode():
            ids = torch.zeros(1, 2, dtype=torch.long, device=device)
            model(input_ids=ids, position_ids=torch.arange(2, device=device)[None], use_cache=False, paged=sentinel)
    except Exception as exc:  # noqa: BLE001 - whatever the model's forward makes of it
        raise ConfigError(f"the model's forward fails with the engine's attention ({exc.__class__.__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); serve it with vLLM behind the gateway",
                          "model.path") from None
    finally:
        _set_attention(model, register())
    kind = getattr(model.config, "model_type", "this model")
    try:
        unfit = _unfit_by_config(model.config, max_model_len)
    except Exception:  # noqa: BLE001 - a config of an unusual shape: the forward's probe still judges it
        log.warning("could not read the model's config for what the engine does not apply", exc_info=True)
        unfit = None
    unfit = unfit or _unfit_by_probe(seen, sentinel, max_model_len)
    if unfit is not None:
        raise ConfigError(f"the kvgate engine cannot serve {kind} exactly: {unfit}; its answers would differ from the "
                          "model's own. Serve it with vLLM behind the gateway (deploy/vllm.md).", "model.path")


def _unfit_by_probe(seen: dict, sentinel: object, max_model_len: int) -> str | None:
    """What the probe's forward shows the engine does not apply, or None: ``seen``
    holds each layer's keywords to attention, ``sentinel`` the ``paged=`` it was sent."""
    if not seen:
        return "its layers do not call transformers' attention interface (ALiBi models such as Bloom and MPT)"
    if any(kwargs.get("paged") is not sentinel for kwargs in seen.values()):
        return "its layers do not pass the engine's step keywords down to attention (as Falcon's)"
    for layer, kwargs in sorted(seen.items(), key=lambda item: str(item[0])):
        window = kwargs.get("sliding_window")
        if window is not None and window < max_model_len:
            return (f"layer {layer} attends through a sliding window of {window} tokens, which the engine does "
                    f"not apply (it attends to the whole context): model.max_model_len at most {window} keeps "
                    "every request inside it")
        asked = next((name for name in _UNAPPLIED if kwargs.get(name) is not None), None)
        if asked is not None:
            return f"layer {layer} asks for {_UNAPPLIED[asked]}, which the engine does not apply"
    return None


_probes = itertools.count()


def use_paged_attention(model) -> None:
    """Switch a loaded model to the paged attention function."""
    _set_attention(model, register())


def _set_attention(model, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter(name)
            return
        except Exception:  # noqa: BLE001 - older checks reject custom names; the attribute works
            pass
    model.config._attn_implementation = name
