"""Token usage of a client request summed over its engine requests and choices."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.request import GenerationOutput, Usage
from gateway.shapes import usage_dict
from gateway.upstream import USAGE_ALL

if TYPE_CHECKING:
    from gateway.dispatch import Sub


class UsageSum:
    """Usage over sub-requests: prompt counted once per prompt, completions summed."""

    __slots__ = ("prompt", "cached", "completion", "reasoning", "all")

    def __init__(self, subs: int) -> None:
        self.prompt = [0] * subs
        # None until a replica says (an external server may never).
        self.cached: list[int | None] = [None] * subs
        self.completion = [0] * subs
        # Said only in an external server's usage for the whole request (USAGE_ALL).
        self.reasoning: list[int | None] = [None] * subs
        self.all = [False] * subs

    def add(self, sub: int, out: GenerationOutput) -> None:
        u = out.usage
        if u is None:
            return
        if out.index == USAGE_ALL:
            self.prompt[sub], self.cached[sub], self.completion[sub] = u.prompt_tokens, u.cached_tokens, u.completion_tokens
            self.reasoning[sub] = u.reasoning_tokens
            self.all[sub] = True
            return
        if self.all[sub]:
            return
        self.prompt[sub] = max(self.prompt[sub], u.prompt_tokens)
        if out.index == 0:
            # The first choice looked the prompt up; later ones reuse its blocks.
            self.cached[sub] = u.cached_tokens
        self.completion[sub] += u.completion_tokens

    def unsaid(self, sub: int) -> bool:
        """Whether no usage came for sub-request ``sub``, whole or per choice."""
        return not self.all[sub] and not self.prompt[sub] and not self.completion[sub]

    def forget(self, sub: int) -> None:
        """Drop what sub-request ``sub`` reported: it starts over on another replica."""
        self.prompt[sub] = self.completion[sub] = 0
        self.cached[sub] = self.reasoning[sub] = None
        self.all[sub] = False

    def as_dict(self, subs: list[Sub]) -> dict:
        prompt = sum(p or len(s.prompt.token_ids) for p, s in zip(self.prompt, subs))
        # One sub-request that did not say its hits leaves the total unknown.
        cached = None if None in self.cached else sum(self.cached)
        reasoning = None if None in self.reasoning else sum(self.reasoning)
        return usage_dict(Usage(prompt, sum(self.completion), cached, reasoning))
