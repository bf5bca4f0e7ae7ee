"""kvgate gateway: OpenAI-compatible HTTP surface, classification and prefix-aware routing."""
