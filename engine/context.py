"""The workload context that travels with a request to the block cache."""

from __future__ import annotations

from dataclasses import dataclass

WORKLOADS = ("to-c", "to-b", "multimodal")
REQUEST_TYPES = ("text", "search", "image", "file", "api")


@dataclass(slots=True)
class RequestContext:
    """What the cache knows about the request that touches a block.

    The gateway's classifier fills it; trace replay builds it from the trace's
    fields.  Policies read it on every call; none may assume fields beyond these.
    """

    workload: str = "to-c"
    type: str = "text"
    turn: int = 1
    session: str | None = None
    tenant: str | None = None
    # Hash of the first tokens of the prompt (file requests), see the classifier.
    signature: int | None = None
    # Arrival time in seconds (trace time in replay, monotonic time in the engine).
    timestamp: float = 0.0
    prompt_tokens: int = 0
    prompt_blocks: int = 0
    chat_id: int = -1
    parent_chat_id: int = -1
    # Position of the request in a replayed trace; -1 when serving live.
    request_index: int = -1
