"""Record served traffic as a Qwen-Bailian trace for `kvgate replay` and `kvgate tune`.

One JSON line per engine request, written when the request ends (also when
its client left or it failed after the engine's prefill, which cached its
prompt all the same, or left during an in-process engine's prefill: output 0,
the prompt as far as the engine had scheduled it):
``chat_id``, ``parent_chat_id``, ``turn`` and ``type`` from the gateway's
classification, ``timestamp`` (arrival, seconds since the recording began),
``input_length`` (the prompt's tokens, as the gateway tokenised it: what
``hash_ids`` count) / ``output_length`` (engine-reported tokens) and
``hash_ids``.  Lines are in completion order; readers order them by timestamp.

No prompt text is written: each block key is replaced by a small id that is
stable within one recording file (and meaningless outside it), so prefix
sharing survives and content does not.  Replay chains the ids back into
prefix keys; because each id stands for one chained key, the chain rebuilds
exactly the engine's prefix structure.  The trailing partial block of a
prompt gets a fresh id of its own, as in the Bailian traces:
``len(hash_ids) == ceil(input_length / block)``.  Ids are per engine block,
``block_tokens`` tokens each (16 by default, the Bailian convention).

Fields beyond the public format (readers that do not know them ignore them),
so that replay does what the engine did rather than approximately so:
- ``workload``: the gateway's workload (otherwise guessed from the type);
- ``cacheable_blocks``: the full prompt blocks, on every line; the engine never
  caches a partial block, so replay counts it as an access but does not insert
  it, and never counts the block holding the prompt's last token as a hit (the
  engine computes that one for its logits);
- ``output_hash_ids``: the blocks the engine filled with generated tokens and
  cached (in-process and `kvgate engine` replicas, whose outputs carry token
  ids; not external servers); a later turn
  that resends the answer hits them, so replay caches them after the prompt,
  uncounted;
- ``block_tokens``: the engine's block size when it is not 16 (on every line;
  a file holds one size);
- ``session_id``: the request's session as the engine's policy saw it (the
  ``prompt_cache_key`` or ``user`` field when given, else the conversation), a small per-file id; the
  workload-aware policy keys its topic-switch detector and its shared class on
  it, and chat ids alone only rebuild conversations;
- ``duration_s``: seconds from arrival to the request's end, for which the
  engine held its blocks; replay holds them as long (a policy that scores blocks
  by age sees them released when the engine released them).

Past ``max_bytes`` (or ``max_bytes / 64`` distinct blocks, 65,536 at least,
whose id map would otherwise hold many times the file's size) the file rotates (FILE -> FILE.1 ->
...; ``keep`` files) and the id maps start afresh, so each file is a
self-contained trace and memory stays within ~2x ``max_bytes``: block, chat and session ids count from 1 in each file,
timestamps from the file's opening, and a parent recorded in an earlier file
is -1 (the turn still says how deep the conversation is).  An existing FILE is rotated away at start for the same
reason: appending new ids to an old recording would alias unrelated blocks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from pathlib import Path
from typing import Sequence

from engine.block_hash import hash_block, root_hash
from engine.context import RequestContext


class TraceRecorder:
    def __init__(self, path: str | os.PathLike, max_bytes: int = 64 * 1024 * 1024, keep: int = 5,
                 block_tokens: int = 16, clock=time.monotonic) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = max(1, keep)
        self.block_tokens = block_tokens
        self._clock = clock
        if self.path.is_dir():
            # Rotation would rename the directory itself out of the way.
            raise IsADirectoryError(errno.EISDIR, "is a directory, give a file path", str(self.path))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size > 0:
            self._shift_old_files()
        self._open()

    def record(self, ctx: RequestContext, block_keys: Sequence[int], prompt_tokens: int,
               completion_tokens: int, arrival: float | None = None, output_keys: Sequence[int] = ()) -> None:
        """One completed request; ``arrival`` is on the recorder's clock (monotonic by default).

        ``output_keys``: keys of the blocks the engine filled with generated
        tokens and cached (see ``generated_keys``); a later turn that resends
        the answer hits them, so replay must know they were cached.
        """
        if os.fstat(self._file.fileno()).st_nlink == 0:
            # Deleted (its folder, say) while recording: the lines would go to a file no
            # one can read, unsaid until the next rotation failed (64 MiB later by default).
            raise FileNotFoundError(errno.ENOENT, "the recording was deleted while the gateway wrote it", str(self.path))
        ids = self._ids_of(block_keys)
        full = len(ids)
        blocks = -(-prompt_tokens // self.block_tokens)
        while len(ids) < blocks:
            ids.append(self._fresh_id())
        # Chat ids per file: a parent's line comes before its next turn's (the engine
        # ended it before the client could send that turn), so it is mapped by then.
        self._next_chat += 1
        chat_id = self._next_chat
        if ctx.chat_id >= 0:
            self._chats[ctx.chat_id] = chat_id
        parent = self._chats.get(ctx.parent_chat_id, -1) if ctx.parent_chat_id >= 0 else -1
        ended = self._clock()
        timestamp = (arrival if arrival is not None else ended) - self._start
        fields = {
            "chat_id": chat_id,
            "parent_chat_id": parent,
            "timestamp": round(max(timestamp, 0.0), 6),
            "input_length": prompt_tokens,
            "output_length": completion_tokens,
            "type": ctx.type,
            "turn": ctx.turn,
            "workload": ctx.workload,
            "hash_ids": ids,
        }
        # The engine never caches a partial block: replay counts it, but does not insert
        # it.  On every line: it also marks the line as an engine's (replay then never
        # counts the block holding the prompt's last token as a hit, as the engine does not).
        fields["cacheable_blocks"] = full
        if ctx.session is not None:
            # The session the engine's policy keyed on (the `user` field when given, else the
            # conversation), as a small per-file id: replay cannot rebuild it from chat ids.
            session = self._sessions.get(ctx.session)
            if session is None:
                session = self._sessions[ctx.session] = len(self._sessions) + 1
            fields["session_id"] = session
        if output_keys:
            fields["output_hash_ids"] = self._ids_of(output_keys)
        if arrival is not None:
            # The engine held the request's blocks from its start to its end: replay
            # holds them as long (a policy that scores by age sees them released then).
            fields["duration_s"] = round(max(ended - arrival, 0.0), 6)
        if self.block_tokens != 16:
            # Replay chains the output ids after the prompt's last full block.
            fields["block_tokens"] = self.block_tokens
        data = (json.dumps(fields, separators=(",", ":")) + "\n").encode("ascii")
        # Unbuffered, a line a write: a crash loses at most the line being written.
        try:
            view = memoryview(data)
            while view:
                view = view[self._file.write(view):]
        except OSError:
            # A full disk (or a file size limit) took part of the line: cut it off, so
            # that the file left ends with a whole line and replay reads it (a torn
            # last line made `kvgate replay` refuse the whole recording).
            with contextlib.suppress(OSError):
                os.ftruncate(self._file.fileno(), self._bytes)
            raise
        self._bytes += len(data)
        # Or past max_bytes / 64 distinct blocks (65,536 at least, so that a small
        # max_bytes keeps conversations together): each holds ~110 bytes in the id
        # map and ~8 in the file, so a file of distinct blocks held 14x its size in memory.
        if self._bytes >= self.max_bytes or len(self._ids) >= max(self.max_bytes // 64, 65_536):
            self._rotate()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def set_block_tokens(self, block_tokens: int) -> None:
        """Ids per ``block_tokens`` tokens from now on; a file that already holds
        lines at the old size rotates, so that each file has one block size."""
        if block_tokens != self.block_tokens and self._bytes:
            self._rotate()
        self.block_tokens = block_tokens

    def _ids_of(self, keys: Sequence[int]) -> list[int]:
        ids_of = self._ids
        ids = []
        for key in keys:
            block_id = ids_of.get(key)
            if block_id is None:
                block_id = ids_of[key] = self._fresh_id()
            ids.append(block_id)
        return ids

    def _fresh_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _open(self) -> None:
        self._ids: dict[int, int] = {}
        self._next_id = 0
        self._next_chat = 0
        self._chats: dict[int, int] = {}  # the gateway's chat id -> this file's
        self._sessions: dict[str, int] = {}
        self._start = self._clock()  # timestamps count from the file's opening
        self._bytes = 0
        self._file = open(self.path, "wb", buffering=0)

    def _shift_old_files(self) -> None:
        """FILE -> FILE.1 -> FILE.2 ...; the oldest past ``keep`` is dropped."""
        for index in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{index + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))

    def _rotate(self) -> None:
        self._file.close()
        self._shift_old_files()
        self._open()


def generated_keys(prompt_ids: Sequence[int], prompt_keys: Sequence[int], generated: Sequence[int],
                   block_size: int, salt: str | bytes, mm_hashes: Sequence[tuple[int, bytes]] = ()) -> list[int]:
    """Keys of the blocks the engine caches beyond the prompt's full blocks.

    The engine publishes every block whose tokens all have computed KV: the
    prompt and all generated tokens but the last (sampled, never fed back).
    The chain continues from the prompt's last full block exactly as
    ``engine.sequence.Sequence.append`` extends it.
    """
    tokens = list(prompt_ids) + list(generated[:-1])
    full = len(tokens) // block_size
    start = len(prompt_keys)
    if full <= start:
        return []
    extra: dict[int, list[bytes]] = {}
    for offset, content in mm_hashes:
        extra.setdefault(offset // block_size, []).append(content)
    parent = prompt_keys[-1] if prompt_keys else root_hash(salt)
    keys = []
    for index in range(start, full):
        parent = hash_block(parent, tokens[index * block_size:(index + 1) * block_size], extra.get(index, ()))
        keys.append(parent)
    return keys
