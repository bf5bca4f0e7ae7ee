"""Synthetic Qwen-Bailian traces calibrated to the ATC'25 characterisation.

The public Bailian traces are not reachable here, so ``synthesize`` builds
look-alikes from the statistics the paper publishes (README, "Synthetic traces"):

* **to-C** (trace A): chat conversations.  A conversation's prompt is a token
  stream: a shared system prompt (or, for file requests, a document template
  header), the user's first message, then for every later turn the previous
  answer and a new message.  Block ids name 16-token chunks of that stream, so
  a follow-up repeats all the previous prompt's full blocks; the previous
  prompt's partial tail block is completed by new tokens and gets a new id.
  Inter-turn time = answer time + an exponential think time whose mean depends
  on the type (image < text < search < file); long conversations sometimes
  pause for many minutes.  Three quick turns in a row (< 15 s apart) make the
  user switch topic: a new conversation.  Some text conversations are one-shot
  tasks on a long paste.  The trace starts cold: no conversation is under way
  at time 0, so the first minutes are quieter.
* **to-B** (trace B): single-turn API calls.  Each prompt is a tenant system
  prompt, a task template, then unique content.  Tenants send steady streams,
  jobs (bursts of requests seconds apart) and scheduled jobs that start at the
  top of each hour.  A tiny share of calls are agent-style follow-ups.
* **mixed**: both populations, 60% / 40% of the requests.

``rate`` is the mean number of *requests* per second, follow-up turns included
(to-C conversations start at ``rate / E[turns in the trace]``, the mean taken
from a pilot run, as conversations near the end are cut).  The same seed gives the
same records, and ``write_trace`` writes them byte for byte the same.

``trace_statistics`` measures, on any loaded trace, what the paper reports, so
a reader can put a synthetic (or real) trace beside it.  Times are the loaded
trace's seconds whatever the file's unit (Mooncake files count milliseconds);
a Mooncake trace carries no turns or types, so it reads as single-turn text.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
from collections import Counter
from pathlib import Path

import numpy as np

from engine.traces import MAX_TIMESTAMP, Trace
from engine.whole_file import written_whole

PROFILES = ("to-c", "to-b", "mixed")
BLOCK_TOKENS = 16
MAX_REQUESTS = 20_000_000
# Above any real service's rate (Alibaba's traces run at a few hundred a second);
# to-B builds tenants and hourly batches in proportion to it, whatever the duration.
MAX_RATE = 10_000.0
# Peak memory per request generated: ~20-24 KB measured (a to-C record's block ids
# as Python ints, and the generator's state), with room.  Linux's OOM killer ends
# a process that asks for more than the machine has with no message, so the
# request is refused up front instead.
PEAK_BYTES_PER_REQUEST = 32 * 1024

# -- to-C (trace A) ---------------------------------------------------------
TOC_TYPES = ("text", "search", "image", "file")
TOC_TYPE_SHARE = (0.78, 0.09, 0.07, 0.06)
TOC_TYPE_CDF = np.cumsum(TOC_TYPE_SHARE)
# Internal continuation probabilities, above the published 0.5 / 0.8: topic
# switches, the context cap and the trace end cut chains, and what a one-hour
# trace then shows lands near the published figures.
TOC_NEXT_AFTER_FIRST = 0.52
TOC_NEXT_AFTER_LATER = 0.87
# Conversation length is heavy-tailed: past turn 2 a few conversations go on
# and on, most stop soon.  The aggregate next-turn probability after later
# turns is 1 - 1 / E[later turns] whatever the mix, so the mix keeps it at
# TOC_NEXT_AFTER_LATER while concentrating reuse on long conversations.
TOC_LONG_CHAT_NEXT = 0.93
TOC_SHORT_CHAT_NEXT = 0.7
# A share of text conversations open with a long paste (translate, summarise
# this): one-shot tasks that rarely get a follow-up.  Chats make up the rest
# of the 0.5.  Without them nearly every block is reused and the ideal hit
# ratio, block lifespans and reuse skew all miss the paper's figures.
TOC_TASK_SHARE = 0.45
TOC_TASK_NEXT = 0.15
TOC_TASK_MESSAGE = (2500, 0.9)
# Users come back to a conversation much later now and then (80% of reuses
# within 10 minutes means 20% after).
TOC_RETURN_LATER = 0.3
TOC_RETURN_LATER_MEAN_S = 1200.0
TOC_MAX_CONTEXT = 32_768  # a chat app stops the conversation beyond this
QUICK_TURN_S = 15.0
QUICK_TURNS_BEFORE_SWITCH = 3
DECODE_TOKENS_PER_S = 40.0
# Mean think time (s) between an answer and the next turn, by type.
TOC_THINK_MEAN_S = {"image": 25.0, "text": 60.0, "search": 90.0, "file": 160.0}
# Shared system prompts per type: (variants, median tokens).  Cross-user reuse
# is rare in the paper, so these are short next to the conversation itself.
TOC_SYSTEM_PROMPTS = {"text": (8, 160), "search": (2, 380), "image": (2, 120)}
FILE_TEMPLATES = 40
# (median, sigma) of lognormal token counts.
TOC_FIRST_MESSAGE = {"text": (120, 1.0), "search": (30, 0.8), "image": (30, 0.8), "file": (40, 0.8)}
TOC_NEXT_MESSAGE = {"text": (60, 1.0), "search": (25, 0.8), "image": (25, 0.8), "file": (35, 0.8)}
SEARCH_RESULTS = (1400, 0.5)
IMAGE_TOKENS = (900, 0.5)
IMAGE_NEW_IN_FOLLOW_UP = 0.2
DOCUMENT_TOKENS = (3500, 1.0)
TOC_OUTPUT = {"text": (280, 0.7), "search": (420, 0.6), "image": (180, 0.7), "file": (380, 0.7)}

# -- to-B (trace B) ---------------------------------------------------------
# A busier platform has more tenants, so that per-tenant traffic grows less than
# the rate.  Not exactly the same whatever the rate: the floor of 10 tenants and
# 2 streams, and the Zipf skew over more of them, leave reuse a little sparser
# at low rates (within 10 s: ~75% at rate 0.5, ~85% at rate 5; README).
TOB_TENANTS_PER_RPS = 80
TOB_SYSTEM = (380, 0.8)
TOB_TEMPLATE = (520, 0.8)
TOB_CONTENT = (600, 0.9)
TOB_OUTPUT = (220, 0.8)
TOB_SHARE_STEADY = 0.35  # steady per-template streams
TOB_SHARE_HOURLY = 0.08  # scheduled jobs at the top of each hour
TOB_STEADY_STREAMS_PER_RPS = 12
TOB_JOB_SIZE_MEAN = 30.0
TOB_JOB_GAP = (1.5, 0.8)  # median seconds between a job's requests
TOB_HOURLY_START_MEAN_S = 40.0
TOB_NEW_TEMPLATE = 0.5  # a job brings a template its tenant never used
TOB_AGENT_CHAIN = 6e-5  # a call that starts an agent-style multi-turn chain
TOB_AGENT_NEXT = 0.7
TOB_AGENT_TOOL_TOKENS = (1500, 0.8)

MIXED_TOC_SHARE = 0.6
PILOT_VISITS = 2000
CENSOR_S = 600.0  # next-turn statistics ignore requests this close to the trace end

# The paper's published figures, shown beside the measured ones.
PAPER = {
    "to-c": {
        "ideal_hit_ratio": 0.62,
        "type_text": 0.78,
        "multi_turn_sessions": 0.5,
        "next_turn_after_first": 0.5,
        "next_turn_after_later": 0.8,
        "reuse_within_600s": 0.8,
        "lifespan_p90_s": 612.0,
        "top10_reuse_share": 0.77,
    },
    "to-b": {
        "ideal_hit_ratio": 0.54,
        "type_api": 1.0,
        "multi_turn_requests": 0.001,
        "reuse_within_10s": 0.8,
        "lifespan_p90_s": 0.3,
        "lifespan_p99_s": 97.0,
        "single_turn_hit_share": 0.97,
    },
}


# ---------------------------------------------------------------------------
# Generation


class _Blocks:
    """Allocates per-block content ids; shared segments keep their ids."""

    def __init__(self) -> None:
        self._next = 1
        self._shared: dict[tuple, int] = {}
        self._prefixes: dict[tuple, tuple[list[int], int]] = {}

    def fresh(self, count: int) -> list[int]:
        start = self._next
        self._next += count
        return list(range(start, start + count))

    def shared(self, segments: tuple[tuple[object, int], ...]) -> tuple[list[int], int]:
        """Full-block ids of a shared token prefix made of ``(name, tokens)`` segments.

        A block's content is fixed by the segments up to the last one it
        covers, so two prefixes that agree on those segments share the id.
        Returns the ids and the tokens left over in the partial tail block.
        """
        known = self._prefixes.get(segments)
        if known is None:
            known = self._prefixes[segments] = self._build(segments)
        return list(known[0]), known[1]

    def _build(self, segments: tuple[tuple[object, int], ...]) -> tuple[list[int], int]:
        ends = list(np.cumsum([length for _, length in segments]))
        total = int(ends[-1]) if ends else 0
        ids = []
        segment = 0
        for index in range(total // BLOCK_TOKENS):
            block_end = (index + 1) * BLOCK_TOKENS
            while ends[segment] < block_end:
                segment += 1
            key = (tuple(name for name, _ in segments[: segment + 1]), index)
            block_id = self._shared.get(key)
            if block_id is None:
                block_id = self._shared[key] = self.fresh(1)[0]
            ids.append(block_id)
        return ids, total % BLOCK_TOKENS


class _Context:
    """A prompt as a token stream: full-block ids and the partial tail's size."""

    __slots__ = ("ids", "tail", "tokens")

    def __init__(self, ids: list[int], tail: int) -> None:
        self.ids = ids
        self.tail = tail
        self.tokens = len(ids) * BLOCK_TOKENS + tail

    def extend(self, blocks: _Blocks, tokens: int) -> None:
        total = self.tail + tokens
        self.ids = self.ids + blocks.fresh(total // BLOCK_TOKENS)
        self.tail = total % BLOCK_TOKENS
        self.tokens += tokens

    def prompt(self, blocks: _Blocks) -> list[int]:
        # The partial tail block's content is unique to this request.
        return self.ids + blocks.fresh(1) if self.tail else list(self.ids)


class _Generator:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.blocks = _Blocks()
        self.events: list[tuple[float, int, int, dict]] = []  # (time, seq, parent seq, record)
        self._zipf: dict[tuple[int, float], np.ndarray] = {}

    def lognormal(self, spec: tuple[float, float], low: int = 1, high: int = 1_000_000) -> int:
        median, sigma = spec
        value = median * math.exp(sigma * self.rng.standard_normal())
        return int(min(max(round(value), low), high))

    def zipf_index(self, count: int, exponent: float = 1.0) -> int:
        cdf = self._zipf.get((count, exponent))
        if cdf is None:
            weights = np.cumsum(1.0 / np.arange(1, count + 1) ** exponent)
            cdf = self._zipf[(count, exponent)] = weights / weights[-1]
        return self.pick(cdf)

    def pick(self, cdf: np.ndarray) -> int:
        return min(int(np.searchsorted(cdf, self.rng.random(), side="right")), len(cdf) - 1)

    def emit(self, time: float, parent: int, kind: str, turn: int, ctx: _Context, output: int) -> int:
        seq = len(self.events)
        record = {
            "timestamp": time,
            "input_length": ctx.tokens,
            "output_length": output,
            "type": kind,
            "turn": turn,
            "hash_ids": ctx.prompt(self.blocks),
        }
        self.events.append((time, seq, parent, record))
        return seq

    def arrivals(self, rate: float, duration: float) -> np.ndarray:
        count = self.rng.poisson(rate * duration)
        return np.sort(self.rng.uniform(0.0, duration, count))

    # -- to-C --

    def to_c(self, rate: float, duration: float) -> None:
        for start in self.arrivals(rate / self.requests_per_visit(duration), duration):
            self.visit(float(start), duration)

    def requests_per_visit(self, duration: float) -> float:
        """Mean requests a visit leaves inside the trace, from a pilot run.

        Conversations that start near the end are cut, so the mean depends on
        the duration; measuring it keeps ``rate`` a request rate.
        """
        pilot = _Generator(int(self.rng.integers(2**63)))
        visits = PILOT_VISITS
        for start in pilot.rng.uniform(0.0, duration, visits):
            pilot.visit(float(start), duration)
        return len(pilot.events) / visits

    def visit(self, time: float, duration: float) -> None:
        kind, ctx, first_next = self.new_conversation()
        turn, parent, quick = 1, -1, 0
        later_next, return_later = self.later_next()
        while True:
            output = self.lognormal(TOC_OUTPUT[kind], 1, 4096)
            parent = self.emit(time, parent, kind, turn, ctx, output)
            if self.rng.random() >= (first_next if turn == 1 else later_next):
                return
            gap = 0.5 + output / DECODE_TOKENS_PER_S + self.think_time(kind, return_later)
            time += gap
            if time >= duration:
                return
            quick = quick + 1 if gap < QUICK_TURN_S else 0
            if quick >= QUICK_TURNS_BEFORE_SWITCH:
                # Topic switch: the user opens a new conversation.
                kind, ctx, first_next = self.new_conversation()
                turn, parent, quick = 1, -1, 0
                later_next, return_later = self.later_next()
                continue
            ctx.extend(self.blocks, output + self.follow_up_tokens(kind))
            if ctx.tokens > TOC_MAX_CONTEXT:
                return
            turn += 1

    def later_next(self) -> tuple[float, float]:
        """A conversation's next-turn probability past turn 1 and its chance of a late return."""
        # Mean later turns 1/(1-q) must average 1/(1-TOC_NEXT_AFTER_LATER).
        short, long_ = 1 / (1 - TOC_SHORT_CHAT_NEXT), 1 / (1 - TOC_LONG_CHAT_NEXT)
        share_long = (1 / (1 - TOC_NEXT_AFTER_LATER) - short) / (long_ - short)
        if self.rng.random() < share_long:
            return TOC_LONG_CHAT_NEXT, TOC_RETURN_LATER
        return TOC_SHORT_CHAT_NEXT, 0.0

    def think_time(self, kind: str, return_later: float) -> float:
        if return_later and self.rng.random() < return_later:
            return self.rng.exponential(TOC_RETURN_LATER_MEAN_S)
        return self.rng.exponential(TOC_THINK_MEAN_S[kind])

    def new_conversation(self) -> tuple[str, _Context, float]:
        """A first turn: its type, its prompt, and the chance of a second turn."""
        kind = TOC_TYPES[self.pick(TOC_TYPE_CDF)]
        first_next = TOC_NEXT_AFTER_FIRST
        if kind == "file":
            # The document's first tokens name its template (invoice, contract, ...).
            template = self.zipf_index(FILE_TEMPLATES)
            header = 16 + template * 7 % 32  # 16-47 tokens: the first block is all template
            ids, tail = self.blocks.shared(((("file-template", template), header),))
            ctx = _Context(ids, tail)
            ctx.extend(self.blocks, self.lognormal(DOCUMENT_TOKENS, 200, 30_000))
        else:
            variants, median = TOC_SYSTEM_PROMPTS[kind]
            variant = self.zipf_index(variants)
            # A variant's length is a property of the variant, not of the request.
            length = int(median * (0.5 + variant % 4 * 0.4)) + 3
            ids, tail = self.blocks.shared(((("system", kind, variant), length),))
            ctx = _Context(ids, tail)
            if kind == "search":
                ctx.extend(self.blocks, self.lognormal(SEARCH_RESULTS, 100, 12_000))
            elif kind == "image":
                ctx.extend(self.blocks, self.lognormal(IMAGE_TOKENS, 64, 8_000))
        if kind == "text" and self.rng.random() < TOC_TASK_SHARE:
            ctx.extend(self.blocks, self.lognormal(TOC_TASK_MESSAGE, 64, 24_000))
            return kind, ctx, TOC_TASK_NEXT
        ctx.extend(self.blocks, self.lognormal(TOC_FIRST_MESSAGE[kind], 2, 16_000))
        if kind == "text":
            first_next = (TOC_NEXT_AFTER_FIRST - TOC_TASK_SHARE * TOC_TASK_NEXT) / (1 - TOC_TASK_SHARE)
        return kind, ctx, first_next

    def follow_up_tokens(self, kind: str) -> int:
        tokens = self.lognormal(TOC_NEXT_MESSAGE[kind], 2, 8_000)
        if kind == "search":
            tokens += self.lognormal(SEARCH_RESULTS, 100, 12_000)
        elif kind == "image" and self.rng.random() < IMAGE_NEW_IN_FOLLOW_UP:
            tokens += self.lognormal(IMAGE_TOKENS, 64, 8_000)
        return tokens

    # -- to-B --

    def to_b(self, rate: float, duration: float) -> None:
        # No more tenants or streams than requests: a trace of seconds at a huge rate
        # would otherwise build millions of tenants for a handful of calls.
        requests = math.ceil(rate * duration)
        count = max(10, min(round(TOB_TENANTS_PER_RPS * rate), requests))
        tenants = [
            {"system": self.lognormal(TOB_SYSTEM, 16, 6_000), "templates": [self.template_length()]}
            for _ in range(count)
        ]
        streams = []
        for _ in range(max(2, min(round(TOB_STEADY_STREAMS_PER_RPS * rate), requests))):
            tenant = self.zipf_index(count)
            streams.append((tenant, self.pick_template(tenants[tenant])))
        for time in self.arrivals(rate * TOB_SHARE_STEADY, duration):
            tenant, template = streams[self.zipf_index(len(streams))]
            self.api_call(float(time), tenants, tenant, template, duration)
        job_share = 1.0 - TOB_SHARE_STEADY - TOB_SHARE_HOURLY
        for start in self.arrivals(rate * job_share / TOB_JOB_SIZE_MEAN, duration):
            self.job(float(start), tenants, duration)
        for hour in range(int(math.ceil(duration / 3600.0))):
            jobs = self.rng.poisson(rate * TOB_SHARE_HOURLY * 3600.0 / TOB_JOB_SIZE_MEAN)
            for _ in range(jobs):
                start = hour * 3600.0 + self.rng.exponential(TOB_HOURLY_START_MEAN_S)
                self.job(start, tenants, duration)

    def template_length(self) -> int:
        return self.lognormal(TOB_TEMPLATE, 16, 8_000)

    def pick_template(self, tenant: dict) -> int:
        templates = tenant["templates"]
        if self.rng.random() < TOB_NEW_TEMPLATE:
            templates.append(self.template_length())
            return len(templates) - 1
        return self.zipf_index(len(templates))

    def job(self, time: float, tenants: list[dict], duration: float) -> None:
        tenant = self.zipf_index(len(tenants))
        template = self.pick_template(tenants[tenant])
        size = 1 + int(self.rng.geometric(1.0 / TOB_JOB_SIZE_MEAN))
        gap = self.lognormal((TOB_JOB_GAP[0] * 1000, TOB_JOB_GAP[1]), 50, 60_000) / 1000.0
        for _ in range(size):
            if time >= duration:
                return
            self.api_call(time, tenants, tenant, template, duration)
            time += self.rng.exponential(gap)

    def api_call(self, time: float, tenants: list[dict], tenant: int, template: int, duration: float) -> None:
        spec = tenants[tenant]
        ids, tail = self.blocks.shared(
            ((("tenant", tenant), spec["system"]), (("template", tenant, template), spec["templates"][template]))
        )
        ctx = _Context(ids, tail)
        ctx.extend(self.blocks, self.lognormal(TOB_CONTENT, 8, 30_000))
        output = self.lognormal(TOB_OUTPUT, 1, 4096)
        parent = self.emit(time, -1, "api", 1, ctx, output)
        if self.rng.random() >= TOB_AGENT_CHAIN:
            return
        turn = 1
        while True:
            # Agent loop: the answer and a tool result go back in the next call.
            time += 0.5 + output / DECODE_TOKENS_PER_S + self.rng.exponential(3.0)
            if time >= duration:
                return
            ctx.extend(self.blocks, output + self.lognormal(TOB_AGENT_TOOL_TOKENS, 16, 16_000))
            if ctx.tokens > TOC_MAX_CONTEXT:
                return
            turn += 1
            output = self.lognormal(TOB_OUTPUT, 1, 4096)
            parent = self.emit(time, parent, "api", turn, ctx, output)
            if self.rng.random() >= TOB_AGENT_NEXT:
                return

    # -- output --

    def records(self) -> list[dict]:
        self.events.sort(key=lambda event: (event[0], event[1]))
        chat_ids = {seq: index for index, (_, seq, _, _) in enumerate(self.events)}
        # Renumber block ids in order of first appearance in the trace.
        lengths = [len(event[3]["hash_ids"]) for event in self.events]
        flat = np.fromiter(
            (block for event in self.events for block in event[3]["hash_ids"]), dtype=np.int64, count=sum(lengths)
        )
        _, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
        rank = np.empty(first.size, dtype=np.int64)
        rank[np.argsort(first)] = np.arange(1, first.size + 1)
        renumbered = rank[inverse].tolist()
        offsets = np.concatenate(([0], np.cumsum(lengths))).tolist()
        out = []
        for index, (time, _, parent, record) in enumerate(self.events):
            hash_ids = renumbered[offsets[index] : offsets[index + 1]]
            out.append(
                {
                    "chat_id": index,
                    "parent_chat_id": chat_ids[parent] if parent >= 0 else -1,
                    "timestamp": round(time, 3),
                    "input_length": record["input_length"],
                    "output_length": record["output_length"],
                    "type": record["type"],
                    "turn": record["turn"],
                    "hash_ids": hash_ids,
                }
            )
        return out


def synthesize(profile: str, duration_s: float, rate: float, seed: int) -> list[dict]:
    """Bailian-format records sorted by timestamp; ``rate`` is mean requests per second."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    if not _positive(duration_s):
        raise ValueError(f"duration must be a positive number of seconds, got {duration_s!r}")
    if duration_s > MAX_TIMESTAMP:
        # Its timestamps would be past what a trace may give: replay and --stats would refuse the file.
        raise ValueError(f"duration {duration_s:g} s is past the {MAX_TIMESTAMP:g} s a trace's timestamps may reach")
    if not _positive(rate):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate!r}")
    if rate > MAX_RATE:
        raise ValueError(f"rate {rate:,g} requests per second is above the {MAX_RATE:,.0f} a trace may have")
    asked = duration_s * rate
    if asked > MAX_REQUESTS:
        # Whole requests, rounded up: 3 significant digits said "2e+07" just above the bound.
        raise ValueError(f"duration x rate asks for {math.ceil(asked):,} requests; at most {MAX_REQUESTS:,}")
    memory = _physical_memory_bytes()
    if memory and asked * PEAK_BYTES_PER_REQUEST > memory:
        raise ValueError(f"duration x rate asks for {asked:,.0f} requests, which take ~{asked * PEAK_BYTES_PER_REQUEST / 2**30:.0f} "
                         f"GiB to generate; this machine has {memory / 2**30:.0f} GiB")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    gen = _Generator(int(seed))
    duration_s, rate = float(duration_s), float(rate)
    if profile == "to-c":
        gen.to_c(rate, duration_s)
    elif profile == "to-b":
        gen.to_b(rate, duration_s)
    else:
        gen.to_c(rate * MIXED_TOC_SHARE, duration_s)
        gen.to_b(rate * (1.0 - MIXED_TOC_SHARE), duration_s)
    return gen.records()


def _positive(value: object) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float, np.integer, np.floating))
        and math.isfinite(value)
        and value > 0
    )


def _physical_memory_bytes() -> int | None:
    """The machine's RAM; None where the OS does not say (not Linux or macOS)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def write_trace(records: list[dict], path: str | Path) -> None:
    """Write ``records`` as JSONL (one request per line, fields in a fixed order),
    whole or not at all (see ``engine.whole_file``): an interrupted write leaves
    the old file rather than a shorter trace that reads as a valid one."""
    # A name ending .gz gets what it says (published traces ship so; replay reads both).
    zipped = str(path).endswith(".gz")
    with written_whole(path) as target:
        _write_records(records, target, zipped)


def _write_records(records: list[dict], path: str | Path, zipped: bool = False) -> None:
    with open(path, "wb") as raw, contextlib.ExitStack() as stack:
        if zipped:
            # No name or time in the header: the same seed gives the same bytes, as unzipped.
            raw = stack.enter_context(gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0))
        handle = stack.enter_context(io.TextIOWrapper(raw, encoding="utf-8", newline="\n"))
        for record in records:
            handle.write(json.dumps(record, separators=(", ", ": ")))
            handle.write("\n")


# ---------------------------------------------------------------------------
# Statistics


def trace_statistics(trace: Trace) -> dict:
    """What the paper reports, measured on ``trace`` (prefix semantics, infinite cache).

    Definitions:
    * a *reuse* is any access to a block key seen before; its *reuse time* is
      the time since that key's previous access.  The by-type figures count
      only reuses by follow-up turns of blocks last touched by the same
      conversation (the paper's "reuse time by type for multi-turn");
    * a block's *lifespan* runs from its first to its last access, 0 for a
      block used once (the paper's "dead after" percentiles);
    * *multi-turn sessions* = share of first turns that get a follow-up;
      *multi-turn requests* = share of requests with turn >= 2;
    * *single-turn hits* = hits by first-turn requests (no history of their own).
    """
    # Timestamps a float range apart give infinite spans and gaps: reported as
    # such (or as no rhythm), not as overflow warnings.
    with np.errstate(over="ignore", invalid="ignore"):
        return _measure(trace)


def _measure(trace: Trace) -> dict:
    requests = trace.requests
    n = len(requests)
    times = np.array([r.timestamp for r in requests], dtype=np.float64)
    lengths = np.array([len(r.keys) for r in requests], dtype=np.int64)
    turns = np.array([r.context.turn for r in requests], dtype=np.int64)
    types = [r.context.type for r in requests]
    type_names = sorted(set(types))
    type_index = {name: i for i, name in enumerate(type_names)}
    type_codes = np.array([type_index[t] for t in types], dtype=np.int64)
    session_names: dict[object, int] = {}
    sessions = np.array(
        [session_names.setdefault(_session_of(r), len(session_names)) for r in requests], dtype=np.int64
    )
    # Keys as dense ids in first-seen order: Mooncake hash ids are any JSON
    # integer (a 64-bit hash may exceed int64), and only their identity counts.
    key_ids: dict[int, int] = {}
    keys = np.fromiter((key_ids.setdefault(k, len(key_ids)) for r in requests for k in r.keys), dtype=np.int64,
                       count=int(lengths.sum()))
    owner = np.repeat(np.arange(n), lengths)  # request index of each access
    stats: dict = {"format": trace.format, "requests": n, "accesses": int(keys.size)}
    span = float(times[-1] - times[0]) if n else 0.0
    stats["duration_s"] = span
    stats["ideal_hit_ratio"] = trace.ideal_hit_ratio()
    counts = Counter(types)
    stats["type_mix"] = {name: counts[name] / n for name in type_names}
    stats["workload"] = _workload(stats["type_mix"])

    # Turn structure.
    chat_ids = [r.context.chat_id for r in requests]
    has_child = set(r.context.parent_chat_id for r in requests if r.context.parent_chat_id >= 0)
    followed = np.array([cid in has_child for cid in chat_ids], dtype=bool)
    first = turns <= 1
    stats["multi_turn_requests"] = _ratio((~first).sum(), n)
    # A next turn may fall after the trace ends: leave the last stretch out.
    stats["next_turn_censored"] = censored = span > 2 * CENSOR_S
    early = times <= times[-1] - CENSOR_S if censored else np.ones(n, dtype=bool)
    # In a mixed trace the chat population's turn structure is the one to compare.
    chat = np.array([t != "api" for t in types], dtype=bool)
    if chat.any() and not chat.all():
        early &= chat
    stats["next_turn_after_first"] = _ratio(followed[first & early].sum(), (first & early).sum())
    stats["next_turn_after_later"] = _ratio(followed[~first & early].sum(), (~first & early).sum())
    stats["multi_turn_sessions"] = stats["next_turn_after_first"]

    # Per-access bookkeeping, grouped by key in access (= time) order.
    order = np.argsort(keys, kind="stable")
    grouped_key = keys[order]
    grouped_req = owner[order]
    grouped_t = times[grouped_req]
    starts = np.ones(keys.size, dtype=bool)
    starts[1:] = grouped_key[1:] != grouped_key[:-1]
    reuse = ~starts  # grouped position i re-accesses the key of position i-1
    prev_req = np.concatenate(([0], grouped_req[:-1])) if keys.size else grouped_req
    gaps = (grouped_t - np.concatenate(([0.0], grouped_t[:-1])))[reuse]
    reuse_req = grouped_req[reuse]
    stats["reuses"] = int(gaps.size)
    stats["reuse_time_s"] = _percentiles(gaps)
    stats["reuse_within_10s"] = _ratio((gaps <= 10.0).sum(), gaps.size)
    stats["reuse_within_600s"] = _ratio((gaps <= 600.0).sum(), gaps.size)
    same_session = sessions[prev_req[reuse]] == sessions[reuse_req]
    follow_up = turns[reuse_req] >= 2
    in_chat = same_session & follow_up
    stats["reuse_time_multi_turn_by_type_s"] = {
        name: _percentiles(gaps[in_chat & (type_codes[reuse_req] == code)])
        for name, code in type_index.items()
        if (in_chat & (type_codes[reuse_req] == code)).any()
    }

    # Hits: with chained keys a seen key implies its whole prefix was seen.
    hits_by_req = np.bincount(reuse_req, minlength=n)
    total_hits = int(hits_by_req.sum())
    stats["hits"] = total_hits
    stats["single_turn_hit_share"] = _ratio(hits_by_req[first].sum(), total_hits)
    group_first_req = grouped_req[np.flatnonzero(starts)][np.cumsum(starts) - 1]
    creator_session = sessions[group_first_req][reuse]
    stats["cross_session_hit_share"] = _ratio((creator_session != sessions[reuse_req]).sum(), total_hits)

    # Block lifespans and skew.
    start_idx = np.flatnonzero(starts)
    end_idx = np.concatenate((start_idx[1:], [keys.size])) - 1 if keys.size else start_idx
    lifespans = grouped_t[end_idx] - grouped_t[start_idx]
    stats["unique_blocks"] = int(start_idx.size)
    stats["lifespan_s"] = _percentiles(lifespans, (50, 90, 99))
    reuses_per_block = np.sort(end_idx - start_idx)[::-1]
    top = max(1, int(math.ceil(0.1 * reuses_per_block.size))) if reuses_per_block.size else 0
    stats["top10_reuse_share"] = _ratio(reuses_per_block[:top].sum(), reuses_per_block.sum())

    # Prompt sizes and arrival rhythm.
    inputs = np.array([r.input_length for r in requests], dtype=np.float64)
    outputs = np.array([r.output_length for r in requests], dtype=np.float64)
    stats["input_tokens"] = _percentiles(inputs, (50, 90, 99))
    stats["output_tokens"] = _percentiles(outputs, (50, 90))
    stats["requests_per_minute_median"], stats["top_of_hour_minute_ratio"] = _arrival_rhythm(times)
    return stats


def _arrival_rhythm(times: np.ndarray) -> tuple[float, float]:
    """Median requests per minute of the trace (empty minutes count) and the
    mean of each hour's first minute over that median.

    Counted from the busy minutes alone: a trace whose clock jumps by years
    spans billions of minutes, and an array with one slot per minute would
    not fit in memory.
    """
    if times.size == 0:
        return 0.0, 0.0
    minute = np.floor((times - times.min()) / 60.0)
    if not np.isfinite(minute).all():  # a span beyond the float range: no rhythm to speak of
        return 0.0, 0.0
    busy, counts = np.unique(minute, return_counts=True)
    minutes = int(busy[-1]) + 1
    median = _median_with_zeros(np.sort(counts), minutes - busy.size)
    hours = (minutes - 1) // 60 + 1
    top_of_hour_mean = float(counts[busy % 60 == 0].sum()) / hours
    return median, _ratio(top_of_hour_mean, median)


def _median_with_zeros(sorted_counts: np.ndarray, zeros: int) -> float:
    """The median of ``sorted_counts`` together with ``zeros`` zeros, without building that array."""
    total = zeros + sorted_counts.size

    def at(position: int) -> float:
        return 0.0 if position < zeros else float(sorted_counts[position - zeros])

    return (at((total - 1) // 2) + at(total // 2)) / 2


def _session_of(request) -> object:
    # Mooncake traces name no conversations: each request is its own, not one
    # session shared by the whole trace (which would make every hit "own session").
    ctx = request.context
    return ctx.session if ctx.session is not None else ("request", ctx.chat_id)


def _workload(mix: dict[str, float]) -> str:
    api = mix.get("api", 0.0)
    if api >= 0.999:
        return "to-b"
    if api <= 0.001:
        return "to-c"
    return "mixed"


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0


def _percentiles(values: np.ndarray, points: tuple[int, ...] = (50, 80, 90)) -> dict[str, float]:
    if values.size == 0:
        return {f"p{p}": 0.0 for p in points}
    return {f"p{p}": float(v) for p, v in zip(points, np.percentile(values, points))}


def _seconds(value: float) -> str:
    if value >= 1e7:  # an absurd clock (years between requests) must not widen the whole table
        return f"{value:.3g} s"
    return f"{value:.1f} s" if value >= 1 or value == 0 else f"{value:.2f} s"


def format_statistics(stats: dict) -> str:
    """A table of the measured statistics with the paper's figure beside each."""
    workload = stats.get("workload", "to-c")
    refs = {"to-c": [PAPER["to-c"]], "to-b": [PAPER["to-b"]], "mixed": [PAPER["to-c"], PAPER["to-b"]]}[workload]

    def paper(name: str, fmt) -> str:
        values = [ref[name] for ref in refs if name in ref]
        if len(refs) == 2:
            shown = [fmt(ref[name]) if name in ref else "-" for ref in refs]
            return " / ".join(shown) if values else ""
        return fmt(values[0]) if values else ""

    pct = lambda v: f"{100 * v:.2f}%" if 0 < v < 0.01 else f"{100 * v:.1f}%"  # noqa: E731
    secs = _seconds
    # A trace of 20 minutes or less keeps its last turns, whose next turns may fall after its end.
    low = "" if stats["next_turn_censored"] else " (short trace: low)"
    # Shares of the hits, of none at all: nothing to measure.
    of_hits = pct if stats["hits"] else lambda v: "n/a"  # noqa: E731
    rows: list[tuple[str, str, str]] = [
        ("trace format", stats.get("format", "bailian"), ""),
        ("requests", f"{stats['requests']}", ""),
        ("duration", secs(stats["duration_s"]), ""),
        # Prompts only, as the paper counts; replay (and --capacity fractions) also counts a recording's answer blocks.
        ("unique prompt blocks / accesses", f"{stats['unique_blocks']} / {stats['accesses']}", ""),
        ("ideal hit ratio (prefix)", pct(stats["ideal_hit_ratio"]), paper("ideal_hit_ratio", pct)),
    ]
    for name, share in stats["type_mix"].items():
        rows.append((f"type {name}", pct(share), paper(f"type_{name}", pct)))
    rows += [
        ("multi-turn sessions (first turns followed)", pct(stats["multi_turn_sessions"]) + low,
         paper("multi_turn_sessions", pct)),
        ("multi-turn requests (turn >= 2)", pct(stats["multi_turn_requests"]),
         paper("multi_turn_requests", lambda v: f"<{100 * v:.1f}%")),
        ("P(next turn | turn 1)", f"{stats['next_turn_after_first']:.2f}{low}",
         paper("next_turn_after_first", lambda v: f"~{v:.1f}")),
        ("P(next turn | turn >= 2)", f"{stats['next_turn_after_later']:.2f}{low}",
         paper("next_turn_after_later", lambda v: f"~{v:.1f}")),
        ("reuses within 10 s", pct(stats["reuse_within_10s"]), paper("reuse_within_10s", pct)),
        ("reuses within 10 min", pct(stats["reuse_within_600s"]), paper("reuse_within_600s", pct)),
    ]
    reuse = stats["reuse_time_s"]
    rows.append(("reuse time p50 / p80 / p90", " / ".join(secs(reuse[k]) for k in ("p50", "p80", "p90")), ""))
    by_type = stats["reuse_time_multi_turn_by_type_s"]
    ordered = sorted(by_type, key=lambda name: by_type[name]["p50"])
    chat_types = [name for name in ordered if name != "api"]
    for name in ordered:
        value = by_type[name]
        rows.append((f"  multi-turn reuse time {name} p50/p80/p90",
                     " / ".join(secs(value[k]) for k in ("p50", "p80", "p90")), ""))
    if chat_types:
        rows.append(("  order by median (chat types)", " < ".join(chat_types),
                     "image < text < search < file" if workload != "to-b" else ""))
    life = stats["lifespan_s"]
    rows += [
        ("block lifespan p50", secs(life["p50"]), ""),
        ("block lifespan p90 (90% dead after)", secs(life["p90"]), paper("lifespan_p90_s", secs)),
        ("block lifespan p99", secs(life["p99"]), paper("lifespan_p99_s", secs)),
        ("reuses on the top 10% of blocks", pct(stats["top10_reuse_share"]), paper("top10_reuse_share", pct)),
        ("hits from single-turn requests", of_hits(stats["single_turn_hit_share"]), paper("single_turn_hit_share", pct)),
        # to-B calls are one session each: there, these are a tenant's own template hits.
        ("hits on blocks another session created", of_hits(stats["cross_session_hit_share"]), ""),
        ("input tokens p50 / p90 / p99", " / ".join(f"{stats['input_tokens'][k]:.0f}" for k in ("p50", "p90", "p99")),
         ""),
        ("output tokens p50 / p90", " / ".join(f"{stats['output_tokens'][k]:.0f}" for k in ("p50", "p90")), ""),
        ("requests per minute (median)", f"{stats['requests_per_minute_median']:.0f}", ""),
        ("top-of-hour minute / median minute", f"{stats['top_of_hour_minute_ratio']:.2f}",
         "spike" if workload != "to-c" else ""),
    ]
    width = [max(len(row[i]) for row in rows + [("statistic", "measured", "paper")]) for i in range(3)]
    lines = [f"{'statistic':<{width[0]}}  {'measured':>{width[1]}}  {'paper':<{width[2]}}".rstrip(),
             f"{'-' * width[0]}  {'-' * width[1]}  {'-' * width[2]}"]
    lines += [f"{a:<{width[0]}}  {b:>{width[1]}}  {c:<{width[2]}}".rstrip() for a, b, c in rows]
    return "\n".join(lines)
