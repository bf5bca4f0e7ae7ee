"""One model forward over a scheduled batch, KV in the engine's pool.

All tokens of the step are packed into one row; positions restart per
sequence and the attention function (engine/attention.py) keeps sequences
apart using the ``PagedBatch`` built here.  Logits are computed only for the
last token of sequences that sample this step.
"""

from __future__ import annotations

import itertools

import torch

from engine.attention import PagedBatch, PrefillItem, check_paged_attention, use_paged_attention
from engine.kv_cache import KVCache
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model, kv: KVCache, block_size: int, device: torch.device, max_model_len: int) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        # varlen_attn metadata; CUDA only (tests may force it to check the metadata).
        self.build_varlen = device.type == "cuda"
        use_paged_attention(model)
        check_paged_attention(model, device, max_model_len)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Forward the step; returns (logits [S, vocab], the S sequences that sample)."""
        ids, positions, paged, sample_rows, samplers = self._prepare(batch)
        keep = torch.tensor(sample_rows if sample_rows else [len(ids) - 1], device=self.device)
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            use_cache=False,
            logits_to_keep=keep,
            paged=paged,
        )
        if not sample_rows:
            return None, []
        return out.logits[0], samplers

    def _prepare(self, batch: list[ScheduledSeq]):
        bs = self.block_size
        dev = self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillItem] = []
        sample_rows: list[int] = []
        samplers: list[Sequence] = []
        cu_q, seq_lens, tables = [0], [], []
        for seq, count in batch:
            start, row = seq.num_computed, len(ids)
            end = start + count
            table = seq.block_table
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            used = table[: -(-end // bs)]
            if count == 1:
                decode_rows.append(row)
                decode_tables.append(used)
                decode_lens.append(end)
            elif start == 0:
                prefills.append(PrefillItem(row, count, 0, None, None))
            else:
                visible = torch.arange(end, device=dev)[None, :] <= torch.arange(start, end, device=dev)[:, None]
                blocks = torch.tensor(used, device=dev)
                prefills.append(PrefillItem(row, count, start, blocks, visible[None, None]))
            if end == seq.num_tokens:
                sample_rows.append(row + count - 1)
                samplers.append(seq)
            cu_q.append(cu_q[-1] + count)
            seq_lens.append(end)
            tables.append(used)
        paged = PagedBatch(self.kv, torch.tensor(slots, device=dev), prefills=prefills)
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            paged.decode_index = torch.tensor(decode_rows, device=dev)
            paged.decode_blocks = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], device=dev)
            lens = torch.tensor(decode_lens, device=dev)
            paged.decode_mask = (torch.arange(width * bs, device=dev)[None, :] < lens[:, None])[:, None, None, :]
        if self.build_varlen:
            width = max(len(t) for t in tables)
            i32 = torch.int32
            paged.cu_seq_q = torch.tensor(cu_q, dtype=i32, device=dev)
            paged.seq_lens = torch.tensor(seq_lens, dtype=i32, device=dev)
            paged.block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=i32, device=dev)
            paged.cu_seq_k = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=i32, device=dev)
            paged.context_slots = torch.tensor(
                [t[p // bs] * bs + p % bs for t, n in zip(tables, seq_lens) for p in range(n)], device=dev
            )
            paged.max_q = max(count for _, count in batch)
            paged.max_k = max(seq_lens)
        return ids, positions, paged, sample_rows, samplers
