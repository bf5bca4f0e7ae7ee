"""Record served traffic as a Qwen-Bailian trace for `kvgate replay` and `kvgate tune`.

No prompt text is written: each block key is replaced by a small id that is
stable within one recording (and meaningless outside it), so prefix sharing
survives and content does not.  Replay chains the ids back into prefix keys,
and because each id stands for one chained key, the chain reproduces exactly
the engine's prefix structure.  The trailing partial block of a prompt gets an
id of its own, as in the Bailian traces (len(hash_ids) == ceil(input_length / 16)).

Past ``max_bytes`` the file rotates (FILE -> FILE.1 -> ...) and the id maps
start afresh, so each file is a self-contained trace and memory stays bounded.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Sequence

from engine.context import RequestContext


class TraceRecorder:
    def __init__(self, path: str | os.PathLike, max_bytes: int = 64 * 1024 * 1024, keep: int = 5,
                 block_tokens: int = 16) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self.block_tokens = block_tokens
        self._start = time.monotonic()
        self._reset_ids()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def _reset_ids(self) -> None:
        self._ids: dict[int, int] = {}
        self._next_id = 0
        self._next_chat = 0
        self._last_chat_of_session: dict[str, int] = {}

    def record(self, ctx: RequestContext, block_keys: Sequence[int], prompt_tokens: int,
               completion_tokens: int, now: float | None = None) -> None:
        chat_id = self._next_chat
        self._next_chat += 1
        parent = -1
        if ctx.session is not None:
            parent = self._last_chat_of_session.get(ctx.session, -1)
            self._last_chat_of_session[ctx.session] = chat_id
        ids = [self._id_of(key) for key in block_keys]
        total_blocks = math.ceil(prompt_tokens / self.block_tokens)
        while len(ids) < total_blocks:
            ids.append(self._fresh_id())
        timestamp = (now if now is not None else time.monotonic()) - self._start
        line = json.dumps({
            "chat_id": chat_id,
            "parent_chat_id": parent,
            "timestamp": round(timestamp, 6),
            "input_length": prompt_tokens,
            "output_length": completion_tokens,
            "type": ctx.type,
            "turn": ctx.turn,
            "hash_ids": ids,
        }, separators=(",", ":"))
        self._file.write(line + "\n")
        self._file.flush()
        if self._file.tell() >= self.max_bytes:
            self._rotate()

    def close(self) -> None:
        self._file.close()

    def _id_of(self, key: int) -> int:
        block_id = self._ids.get(key)
        if block_id is None:
            block_id = self._ids[key] = self._fresh_id()
        return block_id

    def _fresh_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _rotate(self) -> None:
        """FILE -> FILE.1 -> FILE.2 ...; the oldest past ``keep`` is dropped."""
        self._file.close()
        for index in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{index + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self._reset_ids()
        self._file = open(self.path, "a", encoding="utf-8")
