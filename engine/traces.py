"""Reading request traces: Qwen-Bailian and Mooncake JSONL.

Both formats become a list of ``TraceRequest`` whose ``keys`` have prefix
semantics (key i identifies the whole prefix up to block i), so replay can
count a hit as the leading run of cached keys.
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from engine.context import REQUEST_TYPES, WORKLOADS, RequestContext

BAILIAN_BLOCK_TOKENS = 16
MOONCAKE_BLOCK_TOKENS = 512

log = logging.getLogger(__name__)

FORMATS = ("auto", "bailian", "mooncake")


class TraceError(ValueError):
    """A trace that cannot be read; the message is ``FILE:LINE: why`` or one line."""


@dataclass(slots=True)
class TraceRequest:
    timestamp: float  # seconds
    keys: list[int]
    input_length: int
    output_length: int
    context: RequestContext = field(default_factory=RequestContext)
    # Blocks the engine filled with generated tokens and cached (recordings only):
    # replay inserts them after the prompt, uncounted, as the engine publishes them.
    output_keys: list[int] = field(default_factory=list)
    # Leading keys the engine could cache (recordings: the full prompt blocks; the
    # trailing partial block is counted as an access but never cached); -1: all.
    cacheable: int = -1
    # Seconds from arrival to the end (recordings): the engine held the request's
    # blocks that long, and replay does too; 0: released at once.
    duration: float = 0.0

    def cacheable_keys(self) -> list[int]:
        """The keys a cache holds after this request (a recording's partial block is not one)."""
        return self.keys[: self.cacheable] if 0 <= self.cacheable < len(self.keys) else self.keys

    def served_hits(self, run: int) -> int:
        """Hit blocks of a leading cached run of ``run`` keys: in a recording, all
        but the block holding the prompt's last token, which the engine computes
        for its logits."""
        return min(run, max(0, len(self.keys) - 1)) if self.cacheable >= 0 else run


@dataclass(slots=True)
class Trace:
    path: str
    format: str
    block_tokens: int
    requests: list[TraceRequest]

    @property
    def accesses(self) -> int:
        return sum(len(r.keys) for r in self.requests)

    def unique_blocks(self) -> int:
        return len({key for r in self.requests for key in (*r.keys, *r.output_keys)})

    def ideal_hit_ratio(self) -> float:
        """Hit ratio of an infinite cache with prefix semantics (caching what replay caches)."""
        seen: set[int] = set()
        hits = 0
        for request in self.requests:
            run = 0
            for key in request.keys:
                if key not in seen:
                    break
                run += 1
            hits += request.served_hits(run)
            seen.update(request.cacheable_keys())
            seen.update(request.output_keys)
        accesses = self.accesses
        return hits / accesses if accesses else 0.0


def workload_of(request_type: str) -> str:
    if request_type == "api":
        return "to-b"
    if request_type == "image":
        return "multimodal"
    return "to-c"


_GZIP_MAGIC = b"\x1f\x8b"


def load_trace(path: str | Path, fmt: str = "auto") -> Trace:
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")
    source = str(path)
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise TraceError(f"{source}: cannot read: {exc.strerror}") from None
    # Published traces ship gzipped; peek, not seek, so a pipe works too.
    try:
        gzipped = handle.peek(2)[:2] == _GZIP_MAGIC
    except OSError as exc:  # opened, but its first bytes cannot be read (an I/O error)
        handle.close()
        raise TraceError(f"{source}: cannot read: {exc.strerror or exc}") from None
    if gzipped:
        handle = gzip.GzipFile(fileobj=handle, mode="rb")
    with handle:
        try:
            return _read_records(handle, source, fmt)
        except (OSError, EOFError, zlib.error) as exc:  # a truncated or corrupt gzip stream
            raise TraceError(f"{source}: cannot read: {exc}") from None


def _read_records(handle: BinaryIO, source: str, fmt: str) -> Trace:
    requests: list[TraceRequest] = []
    chain: dict[tuple[int, int], int] = {}
    sessions: dict[int, int] = {}  # chat id -> id of the conversation's first turn
    notes = _Notes()
    first_looks = ""  # the format the first record looks like
    block_tokens: int | None = None  # a Bailian file's one block size (recordings name it on every line)
    for line_no, raw in enumerate(handle, 1):
        if not raw.strip():
            continue
        where = f"{source}:{line_no}"
        record = _parse_line(raw, where, first=not requests)
        looks = _looks_like(record)
        if not requests:
            first_looks, fmt = looks, _check_format(record, fmt, where)
        elif looks != first_looks:
            notes.add("mixed", where, _mixed_note(first_looks, fmt))
        if fmt == "bailian":
            size = _block_tokens(record, where)
            if block_tokens is None:
                block_tokens = size
            elif size != block_tokens:
                # Hit ratios and the routing simulation count blocks of one size.
                given = f"block_tokens {size}" if "block_tokens" in record else f"no block_tokens (so {size})"
                raise TraceError(f"{where}: {given}, where the lines before give {block_tokens}; a trace holds one "
                                 "block size (record each engine block size to a file of its own)")
            requests.append(_bailian_request(record, where, chain, len(requests), notes, size))
            if looks == first_looks:  # a stray record of the other format has had its warning
                _check_block_count(requests[-1], size, "Bailian", where, notes)
        else:
            requests.append(_mooncake_request(record, where, len(requests)))
            if looks == "mooncake":  # a stray Bailian record has had its warning
                _check_block_count(requests[-1], MOONCAKE_BLOCK_TOKENS, "Mooncake", where, notes)
    notes.log()
    if not requests:
        raise TraceError(f"{source}: the trace holds no requests")
    # Stable: requests with equal timestamps keep file order.
    requests.sort(key=lambda r: r.timestamp)
    for index, request in enumerate(requests):
        request.context.request_index = index
        if fmt == "bailian":
            # In arrival order, so a parent is always seen before its child; a
            # recording is written as requests complete, which need not be that order.
            ctx = request.context
            session = str(sessions.setdefault(ctx.chat_id, sessions.get(ctx.parent_chat_id, ctx.chat_id)))
            if ctx.session is None:  # a recording names the engine's own session
                ctx.session = session
    if fmt != "bailian":
        block_tokens = MOONCAKE_BLOCK_TOKENS
    return Trace(source, fmt, block_tokens or BAILIAN_BLOCK_TOKENS, requests)


_BAILIAN_FIELDS = ("chat_id", "parent_chat_id", "type", "turn")


class _Notes:
    """Oddities worth a warning but not a refusal: one warning per kind, at the
    first line that has it, with how many lines did (a converted trace can have
    thousands, and a warning per line would bury everything else)."""

    def __init__(self) -> None:
        self._first: dict[str, str] = {}
        self._count: dict[str, int] = {}

    def add(self, kind: str, where: str, message: str) -> None:
        self._count[kind] = self._count.get(kind, 0) + 1
        self._first.setdefault(kind, f"{where}: {message}")

    def log(self) -> None:
        for kind, text in self._first.items():
            count = self._count[kind]
            log.warning("%s%s", text, f" ({count} such lines; this is the first)" if count > 1 else "")


def _parse_line(raw: bytes, where: str, first: bool) -> dict:
    # Decoded here, not by json.loads, which guesses UTF-16 or -32 from the first
    # bytes and then calls a line of bad UTF-8 no JSON.  A leading BOM is no text.
    bom = 3 if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        text = raw[bom:].decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise TraceError(f"{where}: not UTF-8 text (byte {bom + exc.start + 1} of the line)") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        if first and _looks_like_csv(text):
            raise TraceError(f"{where}: this looks like a CSV header; kvgate reads JSONL traces (Bailian or Mooncake "
                             "format), one JSON object per line, not CSV") from None
        # The line was read alone: json's own "line 1" would only muddle FILE:LINE.
        # json's message may end in "at" already ("Unterminated string starting at").
        at = " " if exc.msg.endswith(" at") else " at "
        raise TraceError(f"{where}: not valid JSON ({exc.msg}{at}column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:  # bad UTF-8, absurd numbers or nesting
        raise TraceError(f"{where}: not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object, got {json.dumps(record)[:40]}")
    return record


def _looks_like_csv(text: str) -> bool:
    """A first line of comma-separated names, bare or quoted: no JSON object
    starts with a letter or a quote."""
    return "," in text and (text[:1].isalpha() or text[:1] == '"')


def _looks_like(record: dict) -> str:
    return "bailian" if any(name in record for name in _BAILIAN_FIELDS) else "mooncake"


def _mixed_note(first_looks: str, fmt: str) -> str:
    """Each line is read as the first one's format; one of the other format gets its
    timestamp unit (Bailian seconds, Mooncake milliseconds) and block ids wrong."""
    if first_looks == "mooncake":
        what = f"a record with Bailian's chat fields ({', '.join(_BAILIAN_FIELDS)})"
    else:
        what = "a record with none of Bailian's chat fields (Mooncake's shape)"
    return (f"{what} in a trace whose first record is {first_looks}: read as {fmt} like the rest; "
            "a trace that mixes the formats replays with wrong timestamps and keys")


def _check_format(first: dict, fmt: str, where: str) -> str:
    """The format to read with, from the first record: auto-detected, or the one
    asked for.  Read as the other format, a trace's timestamps would be off by
    1000x (Mooncake's are milliseconds): a record with Bailian's chat fields is
    not read as Mooncake; one without them is read as Bailian only when asked,
    with a warning (Bailian's chat fields have defaults)."""
    looks = _looks_like(first)
    if fmt == "mooncake" and looks == "bailian":
        raise TraceError(f"{where}: this looks like a bailian trace (it has Bailian's chat fields), not mooncake: "
                         "give --format bailian or auto")
    if fmt == "bailian" and looks == "mooncake":
        log.warning("%s: none of Bailian's %s: reading it as Bailian as asked, timestamps in seconds (a Mooncake "
                    "trace's are milliseconds)", where, ", ".join(_BAILIAN_FIELDS))
    return looks if fmt == "auto" else fmt


_INT64 = 2**63


def _field(record: dict, name: str, kind: type | tuple, where: str, default=None):
    if name not in record:
        if default is not None:
            return default
        raise TraceError(f"{where}: missing field {name!r}")
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TraceError(f"{where}: field {name!r} must be {_kind_name(kind)}, got {value!r}"[:300])
    if kind is int and not -_INT64 <= value < _INT64:
        # JSON integers are unbounded; a length, turn or chat id past 64 bits is a broken record.
        raise TraceError(f"{where}: field {name!r} is out of range, got {value}"[:300])
    return value


def _kind_name(kind: type | tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "a list"}
    if isinstance(kind, tuple):
        return " or ".join(names.get(k, k.__name__) for k in kind)
    return names.get(kind, kind.__name__)


def _hash_ids(record: dict, where: str, name: str = "hash_ids") -> list[int]:
    ids = _field(record, name, list, where)
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TraceError(f"{where}: {name} must hold integers, found {value!r}"[:300])
    return ids


def _lengths(record: dict, where: str) -> tuple[int, int]:
    input_length = _field(record, "input_length", int, where)
    output_length = _field(record, "output_length", int, where, default=0)
    if input_length < 0 or output_length < 0:
        raise TraceError(f"{where}: lengths must be >= 0")
    return input_length, output_length


def _timestamp(record: dict, where: str) -> float:
    value = _field(record, "timestamp", (int, float), where)
    try:
        value = float(value)
    except OverflowError:
        raise TraceError(f"{where}: timestamp out of range") from None
    if not math.isfinite(value):
        raise TraceError(f"{where}: timestamp must be finite")
    if abs(value) > MAX_TIMESTAMP:
        # Finite, but replay subtracts timestamps: -1.7e308 and 1.7e308 are inf apart,
        # and the policies' windows then compute NaN (a traceback, not a FILE:LINE).
        raise TraceError(f"{where}: timestamp out of range (at most {MAX_TIMESTAMP:g} either side of 0), got {value:g}")
    return value


def _duration(record: dict, where: str) -> float:
    value = _field(record, "duration_s", (int, float), where)
    try:
        value = float(value)
    except OverflowError:  # an integer past any float
        value = math.inf
    if not 0.0 <= value <= MAX_TIMESTAMP:  # NaN fails both
        raise TraceError(f"{where}: duration_s must be from 0 to {MAX_TIMESTAMP:g} seconds, got {value:g}")
    return value


# Far past any clock: 1e15 seconds is 31 million years, and as Mooncake's milliseconds
# 31,000 years; epoch times (1.7e9 s, 1.7e12 ms) are well inside.
MAX_TIMESTAMP = 1e15


def _check_block_count(request: TraceRequest, block_tokens: int, fmt: str, where: str, notes: _Notes) -> None:
    """Both formats' invariant: one hash id per block of ``block_tokens`` tokens, the
    last one partial.  A trace that breaks it was cut or converted wrongly, and its
    hit ratios count the wrong blocks."""
    length = request.input_length
    expected = -(-length // block_tokens)
    if len(request.keys) != expected:
        notes.add("hash_ids", where, f"{len(request.keys)} hash_ids for input_length {length}; a {fmt} trace has "
                                     f"ceil({length} / {block_tokens}) = {expected}, one per block")


def _mooncake_request(record: dict, where: str, index: int) -> TraceRequest:
    input_length, output_length = _lengths(record, where)
    # Mooncake ids already have prefix semantics; timestamps are milliseconds.
    keys = _hash_ids(record, where)
    timestamp = _timestamp(record, where) / 1000.0
    ctx = RequestContext(
        workload="to-c",
        type="text",
        timestamp=timestamp,
        prompt_tokens=input_length,
        prompt_blocks=len(keys),
        chat_id=index,
    )
    return TraceRequest(timestamp, keys, input_length, output_length, ctx)


def _chain(ids: list[int], parent_key: int, chain: dict[tuple[int, int], int]) -> list[int]:
    keys = []
    for block_id in ids:
        link = (parent_key, block_id)
        parent_key = chain.get(link)
        if parent_key is None:
            parent_key = chain[link] = len(chain) + 1
        keys.append(parent_key)
    return keys


def _block_tokens(record: dict, where: str) -> int:
    block_tokens = _field(record, "block_tokens", int, where, default=BAILIAN_BLOCK_TOKENS)
    if block_tokens < 1:
        raise TraceError(f"{where}: block_tokens must be >= 1, got {block_tokens}")
    return block_tokens


def _bailian_request(
    record: dict, where: str, chain: dict[tuple[int, int], int], index: int, notes: _Notes, block_tokens: int
) -> TraceRequest:
    input_length, output_length = _lengths(record, where)
    ids = _hash_ids(record, where)
    timestamp = _timestamp(record, where)
    request_type = _field(record, "type", str, where, default="text")
    if request_type not in REQUEST_TYPES:
        # Kept as given: the policy keys a category on it like any other type.
        notes.add("type", where, f"type {json.dumps(request_type)[:60]} is none of {', '.join(REQUEST_TYPES)}; "
                  "the policy gives it categories of its own")
    turn = _field(record, "turn", int, where, default=1)
    if turn < 1:
        raise TraceError(f"{where}: turn must be >= 1 (a conversation's first turn is 1), got {turn}")
    chat_id = _field(record, "chat_id", int, where, default=index)
    parent = _field(record, "parent_chat_id", int, where, default=-1)
    # Recordings by `kvgate serve --record-trace` carry the gateway's workload; the
    # public traces do not, and it is inferred from the type.
    workload = record.get("workload")
    if workload not in WORKLOADS:
        if workload is not None:
            notes.add("workload", where, f"workload {json.dumps(workload)[:60]} is none of {', '.join(WORKLOADS)}; "
                      "read from the type instead")
        workload = workload_of(request_type)
    # Bailian ids name single blocks; chain them so a key names a whole prefix.
    keys = _chain(ids, 0, chain)
    output_keys: list[int] = []
    if "output_hash_ids" in record:
        # They continue the prompt's last *full* block (a trailing partial block
        # has an id of its own that nothing else shares).
        full = min(len(keys), input_length // block_tokens)
        output_keys = _chain(_hash_ids(record, where, "output_hash_ids"), keys[full - 1] if full else 0, chain)
    cacheable = _field(record, "cacheable_blocks", int, where, default=-1)
    if "cacheable_blocks" in record and not 0 <= cacheable <= len(keys):
        raise TraceError(f"{where}: cacheable_blocks must be from 0 to the line's {len(keys)} hash_ids, got {cacheable}")
    # Recordings name the session the engine's policy keyed on (gateway/recorder.py).
    session = _field(record, "session_id", (int, str), where) if "session_id" in record else None
    duration = _duration(record, where) if "duration_s" in record else 0.0
    ctx = RequestContext(
        workload=workload,
        type=request_type,
        turn=turn,
        timestamp=timestamp,
        prompt_tokens=input_length,
        # The engine's context counts full prompt blocks only (gateway: len(prompt.keys)).
        prompt_blocks=cacheable if 0 <= cacheable < len(keys) else len(keys),
        session=f"s{session}" if session is not None else None,
        chat_id=chat_id,
        parent_chat_id=parent,
    )
    return TraceRequest(timestamp, keys, input_length, output_length, ctx, output_keys, cacheable, duration)
