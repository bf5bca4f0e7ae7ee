"""kvgate engine: KV block cache, eviction policies, trace replay and the bundled HF engine."""
